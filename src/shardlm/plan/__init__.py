"""Memory planner: will this config fit, per rank, on N GPUs of M GiB? If not, which knob fixes it?

Method: nothing is estimated from formulas. The planner runs the trainer's real code path for ONE
training step, per rank, in the current process, on fake tensors:

1. `dist.init_process_group("fake", FakeStore, rank=0, world_size=W)`: a process group whose
   collectives do nothing but have the right shapes (rank 0 stands for every rank: FSDP shards
   are even up to padding). It is destroyed afterwards; `plan` refuses to run where a process
   group already exists.
2. The model is built by the trainer's own recipe, `shardlm.build.build_model` (LoRA, torchao
   float8 linears, AC, `fully_shard` over the `ParallelDims` mesh with the configured mixed
   precision, reshard_after_forward and CPU offload policy); only its materialisation differs:
   `to_empty` under `FakeTensorMode` (tensors with shapes, dtypes and storage sizes but no memory).
3. AdamW as `build_optimizer` makes it on CUDA (same groups and hyper-parameters, fused), over the
   local shards of the sharded parameters (see `local_adamw`: same memory, no DTensor overhead).
   Its state is created first (zero gradients + one step), because from the second step on the
   moments live through forward and backward: the steady state.
4. One step through the trainer's own `shardlm.train.step.forward_backward` (micro_batch_size x
   seq_len tokens; with grad_accum > 1 two micro-batches with the gradient sync of
   train.grad_sync: `step` keeps unsharded gradients through the first, part of the peak),
   the trainer's grad-norm clip, `optimizer.step()`, `zero_grad`, all inside
   `FSDPMemTracker(model, optimizer)`, which follows every tensor storage that is created and
   freed and labels it.

Numbers (bytes per rank):

* peak: `tracker.get_tracker_snapshot("peak")`: the total at the moment of the step's peak and
  what it was made of then, the tracker's categories grouped as
  params = Sharded Param + Unsharded Param + Buffer, grads = Sharded Grad + Unsharded Grad,
  optimizer = OptState, activations = Activation + Inputs, temporaries = Temp (backward
  temporaries: activation gradients, and the recomputed activations under AC, since the
  recomputation runs inside backward), comm = All Gather + Reduce Scatter (FSDP's collective
  buffers).
* model state: a snapshot after backward and clipping, before `optimizer.step()`: sharded fp32
  params + sharded fp32 gradients + AdamW moments (the "16 bytes per parameter" of mixed precision
  training, divided by the shard degree).
* cpu offload (estimate): the peak over the whole step of (total - sharded params - sharded grads
  - optimizer state), i.e. what stays on the GPU when FSDP's CPUOffloadPolicy keeps those in host
  memory. The H2D/D2H staging copies are not modelled (one block's shard at a time: small).

Checked against real runs (2 gloo ranks, the same tracker in real mode) in
tests/distributed/test_plan_accuracy.py (within 15%; see there).

The fake device is the CPU. FakeTensorMode can fake CUDA tensors without a GPU, but DeviceMesh and
FSDP2 (CUDA streams, `torch.cuda.set_device`) need a CUDA runtime, and this torch build has none.
The accounting is device independent (tensor sizes and lifetimes; FSDP2 runs the same code,
prefetch and reduce-scatter buffers included, on either device). CUDA SDPA (flash /
memory-efficient) keeps the same tensors as the CPU flash kernel used here (output + logsumexp).

What the GPU holds beyond the tensors (`shardlm.plan.device`, each term with its source): the caching
allocator's gaps, from a replay of the step's allocations and frees through its algorithm
(`shardlm.plan.allocator`: expandable segments, a segment per FSDP2 stream), the cuBLAS workspaces (through the
allocator: the two make `max_memory_reserved`), the CUDA context and NCCL's buffers. A config fits when their
total is within the GPU less `headroom` (default 10%), kept for what is not modelled: kernels' transient
workspaces, frees that wait on another stream, allocator corner cases. Host memory: `shardlm.plan.host`.

Modelled as the trainer runs it: LoRA, AC, HSDP, train.grad_sync, fp8 (torchao float8 linears,
emulated on the fake CPU tensors: the same float8 copies), CPU offload (the FSDP policy is applied;
what stays on the GPU is the peak less sharded params, grads and optimizer state), data.document_mask
(micro-batches with positions; the dense SDPA mask as it runs, flex attention by its kernels' tensors:
`shardlm.plan.attention`; the report names the attention assumed). Not modelled,
and said so in the plan's notes: train.compile (eager memory is planned) and the float8 all-gather
(NCCL only: all-gather buffers are planned in bf16, an upper bound).

Models deeper than ~33 layers are planned from two short fake steps (`extrapolate`): equal to the
byte to running every layer (tests/unit/plan/test_plan.py; timings in benchmarks/results/plan_speed_cpu.txt).
`exact=True` runs every layer.
"""

from __future__ import annotations

import dataclasses
import time

import torch.distributed as dist

from shardlm.build import meta_model, model_state_bytes
from shardlm.config import Config
from shardlm.errors import ConfigError, PlanError
from shardlm.parallel.dims import ParallelDims, Topology, resolve_dims
from shardlm.parallel.fsdp import AUTO_HEADROOM, block_param_bytes, mp_policy, single_copy_params, unsharded_blocks
from shardlm.plan.attention import FLEX_NOTE
from shardlm.plan.attention import resolve as resolve_attention
from shardlm.plan.device import device_terms
from shardlm.plan.extrapolate import NotAffine, extrapolate_peak, extrapolate_segments, lerp, period_of, reduced_layers
from shardlm.plan.fake_step import StepMemory, fake_step, model_config
from shardlm.plan.host import host_terms
from shardlm.plan.maxfit import KEYS, MaxReport, largest_fitting
from shardlm.plan.report import DEFAULT_HEADROOM, GIB, Breakdown, PlanReport, Scenario
from shardlm.plan.search import alternatives as search_alternatives
from shardlm.plan.search import cp_degrees, fitting_extras, variant
from shardlm.resolve import base_dtype


def measure(cfg: Config, world_size: int, usable_bytes: int, name: str, overrides: dict | None = None,
            exact: bool = False, document_attention: str = "auto") -> tuple[Scenario, StepMemory]:
    """One scenario: a fake step of `cfg` (or two short ones, extrapolated)."""
    t0 = time.perf_counter()
    mc, _ = model_config(cfg)
    period = period_of(cfg, mc)  # None: the blocks do not repeat (an MoE's dense layers at given indices)
    reduced = None if exact or period is None else reduced_layers(mc.n_layers, period)
    note, step = "", None
    if reduced is not None:
        a, b = (fake_step(cfg, world_size, dataclasses.replace(mc, n_layers=n), phases=True,
                          document_attention=document_attention) for n in reduced)
        try:
            peak, offload = extrapolate_peak(a, b, mc.n_layers, b.n_layers - a.n_layers)
            segments = extrapolate_segments(a.segments, b.segments, a, b, mc.n_layers)
            offload_segments = extrapolate_segments(a.offload_segments, b.offload_segments, a, b, mc.n_layers)
        except NotAffine as e:
            note = f"ran all {mc.n_layers} layers ({e})"
        else:
            t = (mc.n_layers - a.n_layers) / (b.n_layers - a.n_layers)
            state = {k: round(v) for k, v in lerp(a.model_state, b.model_state, t).items()}
            step = StepMemory(n_layers=mc.n_layers, n_params=mc.num_params(),
                              trainable=round(a.trainable + (b.trainable - a.trainable) * t), peak=peak,
                              model_state=state, offload=offload, phases=None, segments=segments,
                              offload_segments=offload_segments)
    if step is None:
        step = fake_step(cfg, world_size, mc, document_attention=document_attention)
    t = cfg.train
    peak = Breakdown.from_flat(step.peak)
    hsdp = cfg.parallel.dp_replicate not in (1, "auto") and world_size > 1
    device = device_terms(peak.total, step.reserved, world_size, hsdp, cfg.parallel.cp)
    offload_device = device_terms(step.offload, step.offload_reserved, world_size, hsdp, cfg.parallel.cp)
    scen = Scenario(name=name, world_size=world_size, micro_batch_size=t.micro_batch_size, seq_len=cfg.data.seq_len,
                    grad_accum=t.grad_accum, ac=t.ac, lora_rank=cfg.lora.rank, cpu_offload=t.cpu_offload,
                    peak=peak, model_state=Breakdown.from_flat(step.model_state), offload_peak_bytes=step.offload,
                    device=device, offload_device=offload_device,
                    peak_bytes=(offload_device if t.cpu_offload else device).total, usable_bytes=usable_bytes,
                    seconds=time.perf_counter() - t0, overrides=dict(overrides or {}), note=note,
                    lora_base_dtype=base_dtype(cfg, "cuda") if cfg.lora.rank > 0 else "")
    return scen, step


def resolve_auto(cfg: Config, mc, world_size: int, gpus_per_node: int, gpu_mem_gib: float) -> tuple[Config, str]:
    """`cfg` with parallel.dp_shard/dp_replicate=auto resolved as the trainer would on `world_size` ranks of
    `gpus_per_node` per node, and the reason (empty when nothing was auto)."""
    if "auto" not in (cfg.parallel.dp_shard, cfg.parallel.dp_replicate):
        return cfg, ""
    if world_size % gpus_per_node:
        raise ConfigError(f"plan: --gpus-per-node {gpus_per_node} does not divide the {world_size} ranks")
    dims, why = resolve_dims(cfg.parallel, Topology(world_size, min(gpus_per_node, world_size), "--gpus-per-node"),
                             lambda: model_state_bytes(cfg, mc), int(gpu_mem_gib * GIB))
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp_replicate=dims.dp_replicate,
                                                                dp_shard=dims.dp_shard))
    return cfg, f"parallel.dp_replicate x dp_shard = {dims.dp_replicate} x {dims.dp_shard}, {why}"


def resolve_reshard(cfg: Config) -> Config:
    """`cfg` as the planner measures it: parallel.reshard_after_forward=auto planned as true (the last block
    unsharded), which is how a run starts; what a run adds later goes only into memory the plan leaves free
    (`auto_reshard_note`)."""
    if cfg.parallel.reshard_after_forward != "auto":
        return cfg
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, reshard_after_forward=True))


def auto_reshard_note(cfg: Config, mc, peak_bytes: int, gpu_mem_gib: float, world_size: int) -> str:
    """What parallel.reshard_after_forward=auto does on top of the plan: after step 2 a run keeps as many more
    of the last blocks unsharded as fit in what its peak left free, less `AUTO_HEADROOM` of the device
    (`parallel.fsdp.settle_auto_reshard`): the same rule applied to the planned peak. Empty when not auto."""
    if cfg.parallel.reshard_after_forward != "auto":
        return ""
    t = cfg.train
    if t.cpu_offload:
        return "parallel.reshard_after_forward=auto: the last block only (CPU offload)"
    one = meta_model(cfg, dataclasses.replace(mc, n_layers=1))
    mp = mp_policy(t.precision("cuda"), t.reduce_dtype)
    block_bytes = block_param_bytes(one.layers[0], mp, single_copy_params(one, world_size, mp, t.cpu_offload))
    spare = int(gpu_mem_gib * GIB * (1 - AUTO_HEADROOM)) - peak_bytes
    k, why = unsharded_blocks("auto", mc.n_layers, block_bytes, spare)
    return (f"parallel.reshard_after_forward=auto: planned with the last block unsharded (as true); after step 2 a "
            f"run keeps {k} of {mc.n_layers} ({why}), peak then up to {(peak_bytes + (k - 1) * block_bytes) / GIB:.2f}"
            " GiB")


def _notes(cfg: Config, shape_note: str | None, attention: str) -> list[str]:
    """One line for each setting the plan does not model exactly."""
    t, notes = cfg.train, []
    if shape_note:
        notes.append(shape_note)
    if t.mixed_precision == "auto":
        notes.append("train.mixed_precision=auto: planned as bf16, what auto picks on GPUs (fp32 on a CPU)")
    if t.mixed_precision == "fp8":
        ag = " (float8 all-gather is NCCL-only and not modelled: all-gathers planned in bf16, an upper bound)" \
            if t.fp8_recipe == "tensorwise" else ""
        notes.append(f"train.mixed_precision=fp8: torchao float8 linears planned with emulated matmuls{ag}")
    if cfg.data.document_mask and attention == "flex":
        notes.append(FLEX_NOTE)
    if t.compile:
        notes.append("train.compile is not modelled: eager memory (compiled blocks usually keep fewer temporaries)")
    if t.grad_accum > 1 and t.grad_sync == "step":
        notes.append("train.grad_sync=step: every rank holds the unsharded gradients of every trainable parameter "
                     "during accumulation (counted here); micro_batch keeps them sharded")
    return notes


def _check(world_size: int, sizes_gib: list[float], headroom: float, document_attention: str) -> tuple[str, str]:
    """The planner's arguments are usable here (else PlanError / ConfigError); the attention backend and why."""
    if dist.is_available() and dist.is_initialized():
        raise PlanError("plan() runs its own fake process group and must be called where no process group "
                        "exists (not inside torchrun/a training job); call dist.destroy_process_group() first")
    if world_size < 1 or not sizes_gib or min(sizes_gib) <= 0 or not 0 <= headroom < 1:
        raise ConfigError(f"plan: need world_size >= 1, gpu_mem_gib > 0 and headroom in [0, 1); got "
                          f"{world_size}, {', '.join(map(str, sizes_gib))}, {headroom}")
    try:
        return resolve_attention(document_attention)
    except ValueError as e:
        raise ConfigError(f"plan: {e}") from None


def plan(cfg: Config, world_size: int, gpu_mem_gib: float, gpus_per_node: int = 8,
         headroom: float = DEFAULT_HEADROOM, alternatives: bool = True, exact: bool = False,
         document_attention: str = "auto") -> PlanReport:
    """Per-rank peak memory of one training step of `cfg` on `world_size` ranks of `gpu_mem_gib` GiB.

    `document_attention` (with data.document_mask): auto | flex | sdpa-mask, see `shardlm.plan.attention`.

    Runs in this process on fake tensors and a fake process group (see the module docstring), so
    it must not be called where a process group already exists. When the config does not fit and
    `alternatives` is true, knobs are tried in their own fake runs (`shardlm.plan.search`); when it
    fits with grad_accum > 1, train.grad_sync=step is offered if it fits too.
    """
    t0 = time.perf_counter()
    backend, why = _check(world_size, [gpu_mem_gib], headroom, document_attention)
    usable = int(gpu_mem_gib * (1 - headroom) * GIB)
    mc, shape_note = model_config(cfg)
    cfg, dims_note = resolve_auto(cfg, mc, world_size, gpus_per_node, gpu_mem_gib)
    base, step = measure(resolve_reshard(cfg), world_size, usable, "as configured", exact=exact,
                         document_attention=backend)
    reshard_note = auto_reshard_note(cfg, mc, base.peak_bytes, gpu_mem_gib, world_size)
    notes = ([dims_note] if dims_note else []) + ([reshard_note] if reshard_note else []) + \
        _notes(cfg, shape_note, backend) + ([base.note] if base.note else [])
    shard = ParallelDims(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, world_size, cfg.parallel.cp).dp_shard
    host = host_terms(cfg, base, min(gpus_per_node, world_size), shard)
    report = PlanReport(model=cfg.model.init_from or cfg.model.preset, n_params=step.n_params,
                        trainable_params=step.trainable, world_size=world_size, gpus_per_node=gpus_per_node,
                        gpu_mem_gib=gpu_mem_gib, headroom=headroom, base=base, notes=notes,
                        document_attention=f"{backend}: {why}" if cfg.data.document_mask else "", host=host,
                        active_params=mc.num_params(active=True) if mc.n_experts else None)

    def run(variant: Config, ws: int, name: str, overrides: dict) -> Scenario:
        return measure(variant, ws, usable, name, overrides, exact=exact, document_attention=backend)[0]

    if alternatives:
        report.alternatives = (search_alternatives(cfg, base, usable, gpus_per_node, run, notes, mc.n_heads)
                               if not base.fits
                               else fitting_extras(cfg, base, usable, gpus_per_node, run))
    report.seconds = time.perf_counter() - t0
    return report


def plan_max(cfg: Config, key: str, world_size: int, sizes_gib: list[float], gpus_per_node: int = 8,
             headroom: float = DEFAULT_HEADROOM, exact: bool = False, document_attention: str = "auto",
             with_cp: bool = False) -> MaxReport:
    """The largest `key` (data.seq_len or train.micro_batch_size) that fits each GPU size (`shardlm.plan.maxfit`).
    `with_cp`: for data.seq_len without parallel.cp, the same search again with the largest CP degree a node
    takes (`search.cp_degrees`), in `cp` / `cp_rows`."""
    t0 = time.perf_counter()
    backend, _ = _check(world_size, sizes_gib, headroom, document_attention)
    mc, shape_note = model_config(cfg)
    cfg, dims_note = resolve_auto(cfg, mc, world_size, gpus_per_node, min(sizes_gib))
    cfg = resolve_reshard(cfg)

    def need(variant: Config) -> int:
        return measure(variant, world_size, 0, "max", exact=exact, document_attention=backend)[0].peak_bytes

    rows, plans = largest_fitting(cfg, key, sizes_gib, headroom, need)
    notes = [n for n in (shape_note, dims_note and f"{dims_note} (resolved for the {min(sizes_gib):g} GiB GPU)") if n]
    notes.append(f"fits: the plan's GPU total within usable memory ({headroom:.0%} headroom); "
                 f"{key} in steps of {KEYS[key][0]}")
    section, name = key.split(".")
    rep = MaxReport(key=key, model=cfg.model.init_from or cfg.model.preset, world_size=world_size,
                    configured=getattr(getattr(cfg, section), name), rows=rows, plans=plans, notes=notes)
    degrees = cp_degrees(cfg, world_size, gpus_per_node, mc.n_heads) if with_cp and key == "data.seq_len" else []
    if degrees:
        rep.cp = degrees[-1]
        with_cp_cfg = variant(cfg, {"parallel.cp": rep.cp, "parallel.dp_shard": -1})
        rep.cp_rows = largest_fitting(with_cp_cfg, key, sizes_gib, headroom, need)[0]
    rep.seconds = time.perf_counter() - t0
    return rep


__all__ = ["Breakdown", "Scenario", "PlanReport", "PlanError", "plan", "plan_max", "measure", "GIB",
           "DEFAULT_HEADROOM"]
