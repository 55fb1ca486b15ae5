"""One training step on fake tensors and a fake process group, built and run by the trainer's own code.

The model comes from `shardlm.build.build_model` with one change, the materialisation: fake storage
(FakeTensorMode: shapes, dtypes and sizes, no memory) instead of real storage and an init. The step
is `shardlm.train.step.forward_backward` + the trainer's `clip_grad_norm_` + AdamW, inside
FSDPMemTracker. With data.document_mask the micro-batches carry positions, as the trainer's do, and the
model masks documents with the attention `shardlm.plan.attention` says (flex through stand-ins).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shardlm._torch_compat import FakeStore, FakeTensorMode
from shardlm.build import build_model, build_model_config
from shardlm.config import Config
from shardlm.errors import ConfigError
from shardlm.models import ModelConfig, get_preset
from shardlm.parallel.dims import ParallelDims
from shardlm.parallel.fsdp import clip_grad_norm_
from shardlm.plan import attention
from shardlm.plan.allocator import replay
from shardlm.plan.device import cublas_workspaces
from shardlm.plan.report import OFFLOADED, flat
from shardlm.plan.tracker import PlanTracker, track_unmanaged
from shardlm.quant.nf4 import assign_empty
from shardlm.train.optim import adopt_state_dtype, build_optimizer
from shardlm.train.step import forward_backward

_DEFAULT_PRESET = "debug"


@dataclass
class StepMemory:
    """What one fake step measured (flat snapshots: the tracker's category names -> bytes)."""

    n_layers: int
    n_params: int
    trainable: int
    peak: dict[str, int]
    model_state: dict[str, int]
    offload: int
    phases: dict | None
    segments: dict[str, int] | None = None  # the replayed caching allocator's segments (`plan.allocator`): bytes
    offload_segments: dict[str, int] | None = None  # the same for what stays on the GPU under CPU offload

    @property
    def reserved(self) -> int:
        """The peak of `torch.cuda.max_memory_reserved()`: tensors + cuBLAS workspaces + allocator gaps."""
        return sum((self.segments or {}).values())

    @property
    def offload_reserved(self) -> int:
        return sum((self.offload_segments or {}).values())

    @property
    def peak_total(self) -> int:
        return self.peak["Total"]


def model_config(cfg: Config) -> tuple[ModelConfig, str | None]:
    """The shape to plan and, when it was not the obvious source, a note saying which one was used.

    The planner needs the shape, not the weights: an `init_from` folder holding only config.json
    plans. Where the folder or its config.json is not there (a fresh checkout, a laptop), the
    shape comes from model.preset, which recipes set to the preset of the same shape.
    """
    hf_dir = cfg.model.hf_dir
    if hf_dir is None or (hf_dir / "config.json").is_file():
        mc = build_model_config(cfg, 0)  # vocab 0: no tokenizer needed to plan
        if hf_dir is None or cfg.model.preset == _DEFAULT_PRESET:
            return mc, None
        preset = get_preset(cfg.model.preset)
        if preset.num_params() != mc.num_params():
            return mc, (f"planned {hf_dir / 'config.json'} ({mc.num_params() / 1e9:.2f}B params); model.preset="
                        f"{cfg.model.preset} ({preset.num_params() / 1e9:.2f}B) differs and was not used")
        return mc, None
    if cfg.model.preset == _DEFAULT_PRESET:
        raise ConfigError(f"model.init_from: {hf_dir / 'config.json'} not found. The planner needs only the shape: "
                          "copy that config.json there, or name the preset of the same shape, e.g. "
                          "--model.preset=llama3_70b (see `shardlm presets`)")
    shape_cfg = copy.deepcopy(cfg)
    shape_cfg.model.init_from = ""
    try:
        mc = build_model_config(shape_cfg, 0)
    except ConfigError as e:
        raise ConfigError(f"{e} (planning model.preset={cfg.model.preset} because {hf_dir} has no config.json)") \
            from None
    where = "does not exist" if not Path(hf_dir).exists() else "has no config.json"
    return mc, f"planned the shape of model.preset={cfg.model.preset}: model.init_from folder {hf_dir} {where}"


def planned_config(cfg: Config) -> Config:
    """What the fake step runs: `cfg`, with float8 matmuls emulated (fake tensors run on the CPU)."""
    c = copy.deepcopy(cfg)
    c.train.mixed_precision = c.train.precision("cuda")  # plans are for GPUs: auto means bf16 there
    if c.train.mixed_precision == "fp8":
        c.train.fp8_emulate = True  # same tensors as the FP8 kernels; no FP8-capable device needed
    c.train.compile = False  # not modelled (see `plan`'s notes): eager memory
    return c


def fake_materialize(mode):
    """build_model's materialisation for the planner: fake storage in `mode`, nothing filled."""
    def materialize(model, cfg: Config, device: torch.device) -> None:
        with mode:
            model.to_empty(device=device)
            assign_empty(model, device)  # NF4 shards (lora.base_dtype=nf4) of the sizes torchao stores
    return materialize


def local_adamw(model, t) -> tuple[torch.optim.AdamW, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The trainer's AdamW (`build_optimizer`: same groups and hyper-parameters, fused as on CUDA),
    over each sharded parameter's local shard instead of the DTensor.

    Memory is the same (the moments are shard-sized either way, and the fused kernel allocates
    nothing); what it saves is DTensor's sharding propagation for one fused op over every parameter,
    which on fake tensors costs seconds and grows with the square of the parameter count.
    Returns the optimizer and (DTensor parameter, its local shard) pairs.
    """
    ref = build_optimizer(model, t, torch.device("cuda"))
    pairs, groups = [], []
    with torch.no_grad():
        for g in ref.param_groups:
            local = []
            for p in g["params"]:
                lp = p.to_local() if hasattr(p, "to_local") else p
                pairs.append((p, lp))
                local.append(lp)
            groups.append({**g, "params": local})
    return torch.optim.AdamW(groups, fused=True), pairs


def _sync_grads(pairs, set_none: bool = False) -> None:
    for p, lp in pairs:
        if set_none:
            p.grad = lp.grad = None
        elif p.grad is not None:
            lp.grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad


def warm_optimizer(optimizer, pairs) -> None:
    """Create the optimizer state, as the first step does (zero gradients: values do not matter).

    With train.optimizer_state_dtype bf16 or int8 the optimizer first becomes the trainer's class
    (`adopt_state_dtype`: its step, bf16 or torchao 8-bit moments, runs in the planned step too) and each
    local shard gets the state of its DTensor parameter (`init_state`: int8 decides per whole parameter
    which moments are 8-bit, as the trainer does).
    """
    low = adopt_state_dtype(optimizer)
    if low is not None:
        for p, lp in pairs:
            low.state[lp] = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in low.init_state(p).items()}
        return
    for _, lp in pairs:
        lp.grad = torch.zeros_like(lp)
    optimizer.step()
    _sync_grads(pairs, set_none=True)


def training_step(model, optimizer, pairs, batches, dims: ParallelDims, cfg: Config, tracker) -> dict:
    """The trainer's step on fake tensors; returns the model-state snapshot taken after backward.

    `forward_backward` (gradient sync per train.grad_sync), the trainer's grad-norm clip, the
    optimizer step, `zero_grad(set_to_none=True)`. The tracker labels each phase.
    """
    n_tokens = sum(b[1].numel() for b in batches) * dims.dp * dims.cp  # parallel.cp: labels are a slice

    def label(k: int) -> None:
        tracker.phase = f"mb{k}"
        if k:
            tracker.reset_mod_stats()  # per-module stats only; it refuses a 2nd root forward otherwise

    loss_sum = forward_backward(model, batches, dims.dp / n_tokens, batches[0][0].device, cfg.train.grad_sync,
                                dims.hsdp, before_micro_batch=label, loss_chunk_tokens=cfg.train.loss_chunk_tokens)
    tracker.phase = "clip"
    clip_grad_norm_([p for p, _ in pairs], cfg.train.grad_clip, flag=loss_sum)
    _sync_grads(pairs)
    state = tracker.get_tracker_snapshot("current")
    tracker.phase = "optim"
    optimizer.step()
    _sync_grads(pairs, set_none=True)
    return state


def micro_batches(cfg: Config, n: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """`n` micro-batches as the trainer's loader makes them: (inputs, labels), and positions with
    data.document_mask (values do not matter to memory; under FakeTensorMode there are none). Under
    parallel.cp inputs and labels are a rank's slice of the rows, positions whole rows (`context_slice`)."""
    b, t = cfg.train.micro_batch_size, cfg.data.seq_len
    out = []
    for _ in range(n):
        x, y = (torch.zeros(b, t // cfg.parallel.cp, dtype=torch.long, device=device) for _ in range(2))
        out.append((x, y, attention.positions(b, t, device)) if cfg.data.document_mask else (x, y))
    return out


def fake_step(cfg: Config, world_size: int, mc: ModelConfig | None = None, phases: bool = False,
              document_attention: str = "auto") -> StepMemory:
    """One fake training step of `cfg` on `world_size` ranks, every layer of its model (or of `mc`);
    document masks (data.document_mask) with `document_attention` (see `shardlm.plan.attention`)."""
    dims = ParallelDims(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, world_size, cfg.parallel.cp)
    mc = mc if mc is not None else model_config(cfg)[0]
    run = planned_config(cfg)
    t = run.train
    dev = torch.device("cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = dims.build_mesh("cpu")  # outside FakeTensorMode: the mesh holds real (tiny) tensors
        mode = FakeTensorMode(allow_non_fake_inputs=True)  # to_empty reads the meta tensors
        model = build_model(run, mc, mesh, dev, materialize=fake_materialize(mode))
        with mode, warnings.catch_warnings():
            # torchao's NF4 all-gather checks the output's data_ptr, which fake tensors warn about
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            optimizer, pairs = local_adamw(model, t)
            trainable = sum(p.numel() for p, _ in pairs)  # global sizes (DTensor.numel)
            warm_optimizer(optimizer, pairs)
            n_micro = min(t.grad_accum, 2)  # the 2nd..k-th micro-batch look the same to memory
            batches = micro_batches(run, n_micro, dev)
            tracker = PlanTracker(model, optimizer)
            tracker.phases = {} if phases else None
            tracker.events = []
            tracker.track_inputs(tuple(batches))
            unmanaged = track_unmanaged(tracker, model)
            with tracker, attention.planned(model, attention.resolve(document_attention)[0]):
                start = len(tracker.events)  # before: what exists when a step starts (params, optimizer state)
                state = training_step(model, optimizer, pairs, batches, dims, run, tracker)
            reserved = replay(cublas_workspaces() + tracker.allocations(0, start), tracker.allocations(start))
            # under CPU offload the sharded parameters, gradients and optimizer state live in host memory
            off_reserved = replay(cublas_workspaces() + tracker.allocations(0, start, skip=OFFLOADED),
                                  tracker.allocations(start, skip=OFFLOADED))
            peak = flat(tracker.get_tracker_snapshot("peak"))
            offload = tracker.offload_peak or (peak["Total"] - sum(peak.get(n, 0) for n in OFFLOADED))
            out = StepMemory(n_layers=mc.n_layers, n_params=mc.num_params(), trainable=trainable, peak=peak,
                             model_state=flat(state), offload=int(offload),
                             phases=None if tracker.phases is None else
                             {k: {**flat(snap), "offload": off} for k, (_, snap, off) in tracker.phases.items()},
                             segments=reserved.mapped(), offload_segments=off_reserved.mapped())
            for h in unmanaged:
                h.remove()
            del model, optimizer, pairs, batches, tracker
    finally:
        dist.destroy_process_group()
    return out

