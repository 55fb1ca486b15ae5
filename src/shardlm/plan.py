"""Memory planner: will this config fit, per rank, on N GPUs of M GiB? If not, which knob fixes it?

Method: nothing is estimated from formulas. The planner runs the trainer's real code path for ONE
training step, per rank, in the current process, on fake tensors:

1. `dist.init_process_group("fake", FakeStore, rank=0, world_size=W)`: a process group whose
   collectives do nothing but have the right shapes (rank 0 stands for every rank: FSDP shards
   are even up to padding). It is destroyed afterwards; `plan` refuses to run where a process
   group already exists.
2. The model is built exactly like the trainer: on `meta`, `apply_lora` (if lora.rank > 0),
   `apply_ac` (train.ac), `apply_fsdp` over the `ParallelDims` mesh (HSDP too) with the configured
   mixed precision and reshard_after_forward; then, under `FakeTensorMode` (tensors with shapes,
   dtypes and storage sizes but no memory), `to_empty`.
3. AdamW as `build_optimizer` makes it on CUDA (same groups and hyper-parameters, fused), over the
   local shards of the sharded parameters (see `local_adamw`: same memory, no DTensor overhead).
   Its state is created first (zero gradients + one step), because from the second step on the
   moments live through forward and backward: the steady state.
4. One step as `Trainer.train_step` does it (micro_batch_size x seq_len tokens; with grad_accum > 1
   two micro-batches, gradient sync off on the first, because the accumulated unsharded gradients
   are part of the peak), CE loss in fp32, backward, grad-norm clipping, `optimizer.step()`,
   `zero_grad`, all inside `FSDPMemTracker(model, optimizer)`, which follows every tensor storage
   that is created and freed and labels it.

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
tests/distributed/test_plan_accuracy.py: equal to the byte for the debug model, within ~6% for a
60M model, where the real gloo run also counts gloo's own copy of the reduce-scatter input.

The fake device is the CPU. FakeTensorMode can fake CUDA tensors without a GPU, but DeviceMesh and
FSDP2 (CUDA streams, `torch.cuda.set_device`) need a CUDA runtime, and this torch build has none.
The accounting is device independent (tensor sizes and lifetimes; FSDP2 runs the same code,
prefetch and reduce-scatter buffers included, on either device). CUDA SDPA (flash /
memory-efficient) keeps the same tensors as the CPU flash kernel used here (output + logsumexp).
Not modelled: the CUDA context and cuBLAS/NCCL workspaces (~0.5-2 GiB), NCCL's internal buffers,
the caching allocator's 512-byte rounding, fragmentation and cross-stream reuse delays, kernels'
scratch memory. `headroom` (default
10% of the GPU) is kept free for those.

Speed: a fake step costs a fixed ~1.5 s (build, to_empty, optimizer, embedding and head) plus
~0.1-0.4 s of CPU per transformer block. Models deeper than ~33 layers (~38 with
train.ac=selective) are planned from two fake steps of 10 and 11 layers (see "fewer layers, same
answer" below): equal to the byte to running every layer in the tests and in
benchmarks/plan_speed.py, and checked on every plan. llama3_70b then takes ~6-10 s per scenario
and llama3_405b ~6 s on a 2-core CPU (every layer: ~20-40 s and ~30 s); a whole 70B plan with its
alternatives ~45 s. `--exact` runs every layer. Alternatives that cannot fit (model state alone
over the limit) are not run.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlm.config import Config
from shardlm.data.loader import IGNORE_INDEX
from shardlm.errors import ConfigError, PlanError

GIB = 1024**3
DEFAULT_HEADROOM = 0.10

# FSDPMemTracker category names (their `.value`) -> the planner's groups.
_GROUPS = {
    "params": ("Sharded Param", "Unsharded Param", "Buffer"),
    "grads": ("Sharded Grad", "Unsharded Grad"),
    "optimizer": ("OptState",),
    "activations": ("Activation", "Inputs"),
    "temporaries": ("Temp",),
    "comm": ("All Gather", "Reduce Scatter"),
}
_OFFLOADED = ("Sharded Param", "Sharded Grad", "OptState")


def _gib(b: float) -> float:
    return b / GIB


def _size(b: float, signed: bool = False) -> str:
    """Bytes for people: GiB, or MiB below 1 GiB."""
    v, unit = (b / GIB, "GiB") if abs(b) >= GIB else (b / 2**20, "MiB")
    return f"{v:+.2f} {unit}" if signed else f"{v:.2f} {unit}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


@dataclass
class Breakdown:
    """Bytes per rank, grouped (see the module docstring); `raw` keeps the tracker's own categories."""

    total: int
    params: int
    grads: int
    optimizer: int
    activations: int
    temporaries: int
    comm: int
    raw: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_snapshot(cls, snap: dict) -> Breakdown:
        return cls.from_flat(_flat(snap))

    @classmethod
    def from_flat(cls, flat: dict[str, int]) -> Breakdown:
        """From category name -> bytes (with "Total"; a planner-only "offload" entry is ignored)."""
        total = flat.get("Total", 0)
        raw = {k: v for k, v in flat.items() if k not in ("Total", "offload")}
        groups = {g: sum(raw.get(n, 0) for n in names) for g, names in _GROUPS.items()}
        return cls(total=total, raw=raw, **groups)


@dataclass
class Scenario:
    """One fake run: a config variant and what it needs per rank."""

    name: str
    world_size: int
    micro_batch_size: int
    seq_len: int
    grad_accum: int
    ac: str
    lora_rank: int
    cpu_offload: bool
    peak: Breakdown  # composition at the peak
    model_state: Breakdown  # after backward, before the optimizer step
    offload_peak_bytes: int  # the peak without sharded params/grads/optimizer state (CPU offload)
    peak_bytes: int  # what the GPU needs: peak.total, or offload_peak_bytes with cpu_offload
    usable_bytes: int
    seconds: float
    overrides: dict[str, Any] = field(default_factory=dict)
    measured: bool = True  # False: not run, peak_bytes is a lower bound (see `note`)
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes

    @property
    def margin_bytes(self) -> int:
        """usable - peak: > 0 is room to spare, < 0 is how much is missing."""
        return self.usable_bytes - self.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["fits"], d["margin_bytes"] = self.fits, self.margin_bytes
        d["peak_gib"], d["margin_gib"] = round(_gib(self.peak_bytes), 3), round(_gib(self.margin_bytes), 3)
        return d


@dataclass
class PlanReport:
    model: str
    n_params: int
    trainable_params: int
    world_size: int
    gpus_per_node: int
    gpu_mem_gib: float
    headroom: float
    base: Scenario
    alternatives: list[Scenario] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return self.base.fits

    @property
    def usable_gib(self) -> float:
        return self.gpu_mem_gib * (1 - self.headroom)

    @property
    def peak_gib(self) -> float:
        return _gib(self.base.peak_bytes)

    def best_alternative(self) -> Scenario | None:
        """The fitting alternative with the most room left, if any."""
        ok = [s for s in self.alternatives if s.fits]
        return max(ok, key=lambda s: s.margin_bytes) if ok else None

    def to_dict(self) -> dict[str, Any]:
        best = self.best_alternative()
        return {
            "model": self.model, "n_params": self.n_params, "trainable_params": self.trainable_params,
            "world_size": self.world_size, "gpus_per_node": self.gpus_per_node, "gpu_mem_gib": self.gpu_mem_gib,
            "headroom": self.headroom, "usable_gib": round(self.usable_gib, 3), "fits": self.fits,
            "peak_gib": round(self.peak_gib, 3), "base": self.base.to_dict(),
            "alternatives": [s.to_dict() for s in self.alternatives],
            "best_alternative": best.name if best else None, "notes": self.notes, "seconds": round(self.seconds, 2),
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def format(self) -> str:
        """A short human-readable report."""
        b = self.base
        nodes = self.world_size / self.gpus_per_node
        lines = [
            f"shardlm plan: {self.model} ({_count(self.n_params)} params, {_count(self.trainable_params)} trainable) "
            f"on {self.world_size} ranks ({nodes:g} x {self.gpus_per_node} GPUs) of {self.gpu_mem_gib:g} GiB; "
            f"usable {_size(b.usable_bytes)} ({self.headroom:.0%} headroom)",
            f"  micro_batch_size={b.micro_batch_size} seq_len={b.seq_len} grad_accum={b.grad_accum} ac={b.ac} "
            f"lora.rank={b.lora_rank} cpu_offload={str(b.cpu_offload).lower()}",
            "",
            f"  {'per rank':<14} {'at peak':>12} {'model state':>12}",
        ]
        for g in ("params", "grads", "optimizer", "activations", "temporaries", "comm"):
            lines.append(f"  {g:<14} {_size(getattr(b.peak, g)):>12} {_size(getattr(b.model_state, g)):>12}")
        lines.append(f"  {'total':<14} {_size(b.peak.total):>12} {_size(b.model_state.total):>12}")
        if b.cpu_offload:
            lines.append(f"  on the GPU with cpu_offload (estimate): {_size(b.offload_peak_bytes)}")
        verdict = "FITS" if b.fits else "DOES NOT FIT"
        lines += ["", f"  peak {_size(b.peak_bytes)} of {_size(b.usable_bytes)} usable: {verdict} "
                      f"({_size(abs(b.margin_bytes))} {'to spare' if b.fits else 'over'})"]
        if self.alternatives:
            lines += ["", f"  {'alternative':<46} {'peak':>12} {'margin':>12}  fits"]
            for s in self.alternatives:
                peak = ("> " if not s.measured else "") + _size(s.peak_bytes)
                lines.append(f"  {s.name:<46} {peak:>12} {_size(s.margin_bytes, signed=True):>12}  "
                             f"{'yes' if s.fits else 'no '}" + (f"  ({s.note})" if s.note else ""))
            best = self.best_alternative()
            lines.append("")
            lines.append(f"  most room: {best.name} ({_size(best.margin_bytes)} to spare)" if best
                         else "  none of the alternatives tried fits")
        for n in self.notes:
            lines.append(f"  note: {n}")
        lines.append(f"  ({self.seconds:.1f}s)")
        return "\n".join(lines)


# -- one fake step ---------------------------------------------------------------------------------

def _lora_module():
    try:
        from shardlm import lora
    except ImportError:
        return None
    return lora if hasattr(lora, "apply_lora") else None


def _ac_mode(cfg: Config) -> str:
    return getattr(cfg.train, "ac", "none") or "none"


def _cpu_offload(cfg: Config) -> bool:
    return bool(getattr(cfg.train, "cpu_offload", False))


def _set(cfg: Config, dotted: str, value: Any) -> None:
    """Set a config value, also keys the Config doesn't declare yet (train.ac, train.cpu_offload)."""
    section, key = dotted.split(".", 1)
    setattr(getattr(cfg, section), key, value)


def build_sharded_model(cfg: Config, mc, mesh):
    """The trainer's model build order on `meta`: LoRA -> AC -> fully_shard (then `to_empty`, init)."""
    from shardlm.models import Transformer
    from shardlm.parallel.ac import apply_ac
    from shardlm.parallel.fsdp import apply_fsdp, mp_policy

    with torch.device("meta"):
        model = Transformer(mc)
    if cfg.lora.rank > 0:
        lora = _lora_module()
        if lora is None:
            raise PlanError("lora.rank > 0 but shardlm.lora.apply_lora is not available")
        lo = cfg.lora
        lora.apply_lora(model, lo.rank, lo.alpha, lo.dropout, lo.targets, train_embeddings=lo.train_embeddings,
                        train_norms=lo.train_norms)
    apply_ac(model, _ac_mode(cfg), getattr(cfg.train, "ac_every", 2))
    apply_fsdp(model, mesh, mp_policy(cfg.train.mixed_precision, cfg.train.reduce_dtype),
               cfg.parallel.reshard_after_forward)
    return model


def _tracker_class():
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

    class PlanTracker(FSDPMemTracker):
        """FSDPMemTracker, lighter and with one more number.

        `_update_peak_stats` runs after every op; upstream it also refreshes the per-module peaks of
        every active module (O(modules) per op), which the planner does not read. Here: the global
        peak snapshot (as upstream) and the peak of what stays on the GPU under CPU offload.
        """

        offload_peak = 0
        phase = "step"  # set by `training_step`: "mb0", "mb1", "clip", "optim"
        phases: dict | None = None  # when a dict: per-phase peaks, for `_extrapolate` (see there)

        def _update_peak_stats(self, peak_state):
            curr = getattr(self, "_curr_mem_snap", None)
            if curr is None:  # a torch whose internals differ: fall back to the upstream bookkeeping
                return super()._update_peak_stats(peak_state)
            total_all = off_all = 0
            for dev, dev_snap in curr.items():
                total = dev_snap["Total"]
                if self._peak_mem.get(dev, 0) < total:
                    self._peak_mem[dev] = total
                    self._peak_mem_snap[dev] = dict(dev_snap)
                off = total - sum(dev_snap.get(k, 0) for k in self._offloaded_keys)
                if off > self.offload_peak:
                    self.offload_peak = off
                total_all += total
                off_all += off
            if self.phases is not None:  # per-phase peaks: [total, snapshot at it, offload peak]
                key = _phase_key(self.phase, self._mod_tracker.parents, self._mod_tracker.is_bw)
                rec = self.phases.get(key)
                if rec is None:
                    self.phases[key] = [total_all, {d: dict(v) for d, v in curr.items()}, off_all]
                else:
                    if total_all > rec[0]:
                        rec[0], rec[1] = total_all, {d: dict(v) for d, v in curr.items()}
                    if off_all > rec[2]:
                        rec[2] = off_all

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # `tensor.device` on a fake tensor is itself an op (prim.device) and the autograd engine
            # asks it hundreds of times per block: it allocates nothing, skip the bookkeeping.
            if func is _prim_device:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    _prim_device = torch.ops.prim.device.default
    PlanTracker._offloaded_keys = tuple(k for k in _FSDPRefType if k.value in _OFFLOADED)
    return PlanTracker


def local_adamw(model, t) -> tuple[torch.optim.AdamW, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The trainer's AdamW (`build_optimizer`: same groups and hyper-parameters, fused as on CUDA),
    over each sharded parameter's local shard instead of the DTensor.

    Memory is the same (the moments are shard-sized either way, and the fused kernel allocates
    nothing); what it saves is DTensor's sharding propagation for one fused op over every parameter,
    which on fake tensors costs seconds and grows with the square of the parameter count.
    Returns the optimizer and (DTensor parameter, its local shard) pairs.
    """
    from shardlm.train.optim import build_optimizer

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
    """Create the optimizer state, as the first step does (zero gradients: values do not matter)."""
    for _, lp in pairs:
        lp.grad = torch.zeros_like(lp)
    optimizer.step()
    _sync_grads(pairs, set_none=True)


def training_step(model, optimizer, pairs, batches, dp: int, grad_clip: float, tracker=None):
    """What `Trainer.train_step` does to memory; returns the model-state snapshot taken after backward.

    Forward, fp32 CE (sum) and backward of each micro-batch (gradient sync on the last only), the
    global grad-norm clip (over the local shards: the trainer's all-reduce of one scalar is left
    out), the optimizer step, `zero_grad(set_to_none=True)`.
    """
    from shardlm.parallel.fsdp import clip_grad_norm_

    n_tokens = sum(y.numel() for _, y in batches) * dp
    scale = dp / n_tokens
    for k, (x, y) in enumerate(batches):
        if tracker is not None:
            tracker.phase = f"mb{k}"
        if len(batches) > 1:
            model.set_requires_gradient_sync(k == len(batches) - 1)
            if k and tracker is not None:
                tracker.reset_mod_stats()  # per-module stats only; it refuses a 2nd root forward otherwise
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
        (loss * scale).backward()
        del logits, loss
    _sync_grads(pairs)
    if tracker is not None:
        tracker.phase = "clip"
    clip_grad_norm_([lp for _, lp in pairs], grad_clip)
    state = tracker.get_tracker_snapshot("current") if tracker is not None else None
    if tracker is not None:
        tracker.phase = "optim"
    optimizer.step()
    _sync_grads(pairs, set_none=True)
    return state


@dataclass
class _Step:
    """What one fake step measured (flat snapshots: the tracker's category names -> bytes)."""

    n_layers: int
    n_params: int
    trainable: int
    peak: dict[str, int]
    model_state: dict[str, int]
    offload: int
    phases: dict | None


def _flat(snap: dict) -> dict[str, int]:
    """A tracker snapshot ({device: {category: bytes}}) as {category name: bytes}, summed over devices."""
    out: dict[str, int] = {}
    for dev_snap in snap.values():
        for k, v in dev_snap.items():
            name = str(getattr(k, "value", k))
            out[name] = out.get(name, 0) + v
    return out


def _model_config(cfg: Config):
    from shardlm.build import build_model_config

    try:
        return build_model_config(cfg, 0)  # vocab 0: no tokenizer needed to plan
    except ConfigError as e:
        if not cfg.model.init_from:
            raise
        raise ConfigError(f"{e}. The planner needs only its config.json; without the folder, plan the same "
                          "shape from a preset, e.g. --model.init_from= --model.preset=llama3_70b "
                          "--lora.adapters_only=false") from None


def _fake_step(cfg: Config, world_size: int, mc=None, phases: bool = False) -> _Step:
    """One fake training step of `cfg` (see the module docstring), every layer of its model (or of `mc`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardlm.parallel.dims import ParallelDims

    dims = ParallelDims(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, world_size)
    mc = mc if mc is not None else _model_config(cfg)
    t, d = cfg.train, cfg.data
    dev = torch.device("cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = dims.build_mesh("cpu")  # outside FakeTensorMode: the mesh holds real (tiny) tensors
        model = build_sharded_model(cfg, mc, mesh)  # on meta, as the trainer shards it
        with FakeTensorMode(allow_non_fake_inputs=True):  # to_empty reads the meta tensors
            model.to_empty(device=dev)  # fake storages: shapes and sizes, no memory
            optimizer, pairs = local_adamw(model, t)
            trainable = sum(p.numel() for p, _ in pairs)  # global sizes (DTensor.numel)
            warm_optimizer(optimizer, pairs)
            n_micro = min(t.grad_accum, 2)  # the 2nd..k-th micro-batch look the same to memory
            batches = [(torch.zeros(t.micro_batch_size, d.seq_len, dtype=torch.long, device=dev),
                        torch.zeros(t.micro_batch_size, d.seq_len, dtype=torch.long, device=dev))
                       for _ in range(n_micro)]
            tracker = _tracker_class()(model, optimizer)
            tracker.phases = {} if phases else None
            tracker.track_inputs(tuple(batches))
            with tracker:
                state = training_step(model, optimizer, pairs, batches, dims.dp, t.grad_clip, tracker)
            peak = _flat(tracker.get_tracker_snapshot("peak"))
            offload = tracker.offload_peak or (peak["Total"] - sum(peak.get(n, 0) for n in _OFFLOADED))
            out = _Step(n_layers=mc.n_layers, n_params=mc.num_params(), trainable=trainable, peak=peak,
                        model_state=_flat(state), offload=int(offload),
                        phases=None if tracker.phases is None else
                        {k: {**_flat(snap), "offload": off} for k, (_, snap, off) in tracker.phases.items()})
            del model, optimizer, pairs, batches, tracker
    finally:
        dist.destroy_process_group()
    return out


# -- fewer layers, same answer ---------------------------------------------------------------------
#
# Every transformer block is the same module with the same shapes, so the memory of a step is, at
# every moment, affine in the number of layers L: each block adds its sharded params, grads and
# AdamW moments for the whole step, and, between its forward and its backward, its saved
# activations. A step is a sequence of phases (forward of block k, backward of block k, the loss,
# the clip, the optimizer step; per micro-batch). The planner records each phase's own peak (and
# the composition at it). For the phases outside the blocks, and for the first and last EDGE
# blocks (FSDP's prefetch and the unresharded last block make those differ), the peak is affine in
# L; for a middle block k it is affine in (k, L), so over the middle blocks its maximum is at the
# first or the last one. Two fake steps with L_a and L_a + p layers (p: the period of
# train.ac=selective's every-n-th pattern, else 1) fix every line; the plan for L layers is the
# maximum over the phases of their lines at L. Every point of both runs is checked against the
# fit (to the byte in practice); if any is off, or the phases of the two runs differ, the planner
# runs all L layers instead. tests/unit/test_plan.py compares this with all-layer runs.

_EDGE = 2
_MIN_SAVING = 12  # blocks: see `_reduced_layers` (tests lower it to extrapolate small models)


def _phase_key(phase: str, parents, is_bw: bool) -> tuple:
    """(phase, forward/backward, (the block running,) or (), the root's other modules running)."""
    blocks, other = [], []
    for fqn in parents:
        parts = fqn.split(".")
        if len(parts) >= 3 and parts[1] == "layers" and parts[2].isdigit():
            blocks.append(int(parts[2]))
        elif len(parts) == 2:
            other.append(parts[1])
    # The block running is the last one entered: the highest index in forward, the lowest in
    # backward. Blocks whose backward has ended can linger in `parents` (with frozen LoRA bases the
    # tracker drops none until the end of backward): not part of the key.
    if blocks:
        blocks = [min(blocks) if is_bw else max(blocks)]
    return phase, bool(is_bw), tuple(blocks), tuple(sorted(other))


def _period(cfg: Config) -> int:
    return max(1, int(getattr(cfg.train, "ac_every", 2))) if _ac_mode(cfg) == "selective" else 1


def _reduced_layers(n_layers: int, period: int) -> tuple[int, int] | None:
    """The two layer counts to run instead of `n_layers`, or None when running all is as cheap."""
    n0 = 2 * _EDGE + 4 + 2 * period  # >= 2 middle blocks per residue fix its line; the others check it
    n_a = n0 + (n_layers - n0) % period  # same residue as n_layers: same edge pattern
    n_b = n_a + period
    # A fake step costs a fixed part (build, to_empty, optimizer, embedding and head: about what 10
    # blocks cost) plus its blocks: two short steps win once the model is deeper than ~n_a + n_b + 12.
    return (n_a, n_b) if n_layers > max(n_b + period, n_a + n_b + _MIN_SAVING) else None


def _classify(blocks: tuple[int, ...], n: int, period: int):
    """A phase's block (none, or one: see `_phase_key`) -> (class, middle index or None).

    Outside the blocks and in an edge block the class names the block by its index from its nearer
    end; a middle block `m` is classed by its residue mod the period and returned as the index."""
    if not blocks or not _EDGE <= blocks[0] < n - _EDGE:
        return ("edge", tuple(k if k < n - k else k - n for k in blocks)), None
    return ("mid", blocks[0] % period), blocks[0]


class _NotAffine(Exception):
    pass


def _lerp(a: dict[str, int], b: dict[str, int], t: float) -> dict[str, float]:
    keys = set(a) | set(b)
    return {k: a.get(k, 0) + (b.get(k, 0) - a.get(k, 0)) * t for k in keys}


def _close(pred: dict[str, float], actual: dict[str, int]) -> bool:
    tol = max(4096.0, 1e-4 * actual.get("Total", 0))
    return all(abs(pred.get(k, 0) - actual.get(k, 0)) <= tol for k in set(pred) | set(actual))


def _extrapolate(a: _Step, b: _Step, n_layers: int, period: int) -> tuple[dict[str, int], int]:
    """The peak snapshot (and the CPU-offload peak) of an `n_layers` step from two shorter ones."""
    groups: dict[tuple, dict[int, list]] = {}
    for run in (a, b):
        for (phase, bw, blocks, other), flat in run.phases.items():
            cls, m = _classify(blocks, run.n_layers, period)
            groups.setdefault((phase, bw, cls, other), {}).setdefault(run.n_layers, []).append((m, flat))
    t = (n_layers - a.n_layers) / (b.n_layers - a.n_layers)
    preds: list[dict[str, float]] = []
    for key, by_run in groups.items():
        if set(by_run) != {a.n_layers, b.n_layers}:
            raise _NotAffine(f"phase {key} is not in both runs")
        pa, pb = by_run[a.n_layers], by_run[b.n_layers]
        if key[2][0] == "edge":
            preds.append(_lerp(pa[0][1], pb[0][1], t))
            continue
        pa, pb = sorted(pa, key=lambda x: x[0]), sorted(pb, key=lambda x: x[0])
        (m1, f1), (m2, f2) = pa[0], pa[-1]
        if m1 == m2:
            raise _NotAffine(f"phase {key}: one middle block only")
        fb = dict(pb)
        if m1 not in fb:
            raise _NotAffine(f"phase {key}: block {m1} missing in the longer run")

        def at(m: int, n: int, f1=f1, f2=f2, m1=m1, m2=m2, g=fb[m1]) -> dict[str, float]:
            along_k = _lerp(f1, f2, (m - m1) / (m2 - m1))  # same run, another middle block
            # plus what the same block gains per `period` more layers (g: block m1 in the longer run)
            return {k: along_k.get(k, 0) + (g.get(k, 0) - f1.get(k, 0)) * (n - a.n_layers) / period
                    for k in set(along_k) | set(g)}

        for run, pts in ((a, pa), (b, pb)):  # every measured point must lie on the fit
            for m, f in pts:
                if not _close(at(m, run.n_layers), f):
                    raise _NotAffine(f"phase {key}: block {m} of {run.n_layers} is off the fit")
        r = key[2][1]
        lo = _EDGE + (r - _EDGE) % period
        hi = (n_layers - _EDGE - 1) - (n_layers - _EDGE - 1 - r) % period
        preds += [at(lo, n_layers), at(hi, n_layers)]
    for run in (a, b):  # the phases cover the step: their maximum is the run's peak
        if max(f["Total"] for f in run.phases.values()) != run.peak["Total"]:
            raise _NotAffine("the phase peaks miss the step's peak")
    best = max(preds, key=lambda f: f.get("Total", 0))
    peak = {k: max(0, round(v)) for k, v in best.items() if k != "offload"}
    offload = max(0, round(max(f.get("offload", 0) for f in preds)))
    return peak, offload


def _measure(cfg: Config, world_size: int, usable_bytes: int, name: str,
             overrides: dict[str, Any] | None = None, exact: bool = False) -> tuple[Scenario, int, int]:
    t0 = time.perf_counter()
    mc = _model_config(cfg)
    reduced = None if exact else _reduced_layers(mc.n_layers, _period(cfg))
    note = ""
    step = None
    if reduced is not None:
        a, b = (_fake_step(cfg, world_size, dataclasses.replace(mc, n_layers=n), phases=True) for n in reduced)
        try:
            peak, offload = _extrapolate(a, b, mc.n_layers, b.n_layers - a.n_layers)
        except _NotAffine as e:
            note = f"ran all {mc.n_layers} layers ({e})"
        else:
            t = (mc.n_layers - a.n_layers) / (b.n_layers - a.n_layers)
            state = {k: round(v) for k, v in _lerp(a.model_state, b.model_state, t).items()}
            step = _Step(n_layers=mc.n_layers, n_params=mc.num_params(),
                         trainable=round(a.trainable + (b.trainable - a.trainable) * t), peak=peak,
                         model_state=state, offload=offload, phases=None)
    if step is None:
        step = _fake_step(cfg, world_size, mc)
    t = cfg.train
    cpu_offload = _cpu_offload(cfg)
    peak_bd = Breakdown.from_flat(step.peak)
    scen = Scenario(name=name, world_size=world_size, micro_batch_size=t.micro_batch_size, seq_len=cfg.data.seq_len,
                    grad_accum=t.grad_accum, ac=_ac_mode(cfg), lora_rank=cfg.lora.rank, cpu_offload=cpu_offload,
                    peak=peak_bd, model_state=Breakdown.from_flat(step.model_state), offload_peak_bytes=step.offload,
                    peak_bytes=step.offload if cpu_offload else peak_bd.total, usable_bytes=usable_bytes,
                    seconds=time.perf_counter() - t0, overrides=dict(overrides or {}), note=note)
    return scen, step.n_params, step.trainable


def _variant(cfg: Config, overrides: dict[str, Any]) -> Config:
    c = copy.deepcopy(cfg)
    for k, v in overrides.items():
        _set(c, k, v)
    return c


def plan(cfg: Config, world_size: int, gpu_mem_gib: float, gpus_per_node: int = 8,
         headroom: float = DEFAULT_HEADROOM, alternatives: bool = True, exact: bool = False) -> PlanReport:
    """Per-rank peak memory of one training step of `cfg` on `world_size` ranks of `gpu_mem_gib` GiB.

    Runs in this process on fake tensors and a fake process group (see the module docstring), so
    it must not be called where a process group already exists. When the config does not fit and
    `alternatives` is true, each knob is tried in its own fake run: train.ac=full, CPU offload,
    2x and 4x the ranks, LoRA rank 16, smaller micro-batches; if none fits alone, the same
    combined with train.ac=full. Models with many layers are planned from two shorter fake steps
    (see `_extrapolate`); `exact=True` runs every layer instead.
    """
    if dist.is_available() and dist.is_initialized():
        raise PlanError("plan() runs its own fake process group and must be called where no process group "
                        "exists (not inside torchrun/a training job); call dist.destroy_process_group() first")
    if world_size < 1 or gpu_mem_gib <= 0 or not 0 <= headroom < 1:
        raise ConfigError(f"plan: need world_size >= 1, gpu_mem_gib > 0 and headroom in [0, 1); got "
                          f"{world_size}, {gpu_mem_gib}, {headroom}")
    t0 = time.perf_counter()
    usable = int(gpu_mem_gib * (1 - headroom) * GIB)
    notes: list[str] = []
    lora_ok = _lora_module() is not None
    if cfg.lora.rank > 0 and not lora_ok:
        raise PlanError("lora.rank > 0 but shardlm.lora.apply_lora is not available")
    base, n_params, trainable = _measure(cfg, world_size, usable, "as configured", exact=exact)
    report = PlanReport(model=cfg.model.preset if not cfg.model.init_from else cfg.model.init_from,
                        n_params=n_params, trainable_params=trainable, world_size=world_size,
                        gpus_per_node=gpus_per_node, gpu_mem_gib=gpu_mem_gib, headroom=headroom, base=base, notes=notes)
    if base.note:
        notes.append(base.note)
    if cfg.train.mixed_precision == "fp8":
        notes.append("train.mixed_precision=fp8 is planned as bf16 (torchao float8 linears not applied): an upper "
                     "bound; float8 all-gather and float8 saved activations need less")
    if getattr(cfg.train, "compile", False):
        notes.append("train.compile is not modelled: eager memory (compiled blocks usually keep fewer temporaries)")
    if cfg.train.grad_accum > 1:
        notes.append("grad_accum > 1: the trainer turns gradient sync off on all but the last micro-batch, so "
                     "each rank accumulates unsharded gradients of every trainable parameter (counted here)")
    if not base.fits and alternatives:
        report.alternatives = _alternatives(cfg, world_size, gpus_per_node, usable, base, lora_ok, notes, exact)
    report.seconds = time.perf_counter() - t0
    return report


def _alternatives(cfg: Config, world_size: int, gpus_per_node: int, usable: int, base: Scenario,
                  lora_ok: bool, notes: list[str], exact: bool = False) -> list[Scenario]:
    """Try the knobs one at a time, then combined with train.ac=full if none fits alone.

    Runs that cannot fit are not run: the model state (sharded params + grads + optimizer state,
    measured in an earlier run with the same ranks and LoRA setting) is a lower bound on the peak
    that AC and the micro-batch size do not change; such alternatives are listed with that bound
    and `measured=False`. 4x the ranks is only tried when 2x does not fit.
    """
    out: list[Scenario] = []
    ac = _ac_mode(cfg)
    mb = cfg.train.micro_batch_size
    bounds = {(world_size, cfg.lora.rank): base}  # (ranks, lora rank) -> a measured run's model state

    def lower_bound(ws: int, lora_rank: int, offload: bool) -> int:
        ref = bounds.get((ws, lora_rank))
        return 0 if ref is None or offload else ref.model_state.total

    def run(name: str, overrides: dict[str, Any], ws: int = world_size, keep: bool = True) -> Scenario:
        if ws != world_size:
            overrides = {**overrides, "parallel.dp_shard": -1}
        variant = _variant(cfg, overrides)
        lb = lower_bound(ws, variant.lora.rank, _cpu_offload(variant))
        if lb > usable:
            s = dataclasses.replace(
                base, name=name, world_size=ws, micro_batch_size=variant.train.micro_batch_size, ac=_ac_mode(variant),
                lora_rank=variant.lora.rank, peak_bytes=lb, offload_peak_bytes=0, seconds=0.0,
                overrides=overrides, measured=False,
                note=f"not run: the model state alone is {_gib(lb):.1f} GiB > {_gib(usable):.1f} GiB usable")
        else:
            s, _, _ = _measure(variant, ws, usable, name, overrides, exact=exact)
            bounds.setdefault((ws, variant.lora.rank), s)
        if keep:
            out.append(s)
        return s

    def offload_of(s: Scenario, name: str) -> Scenario:
        o = dataclasses.replace(s, name=name, cpu_offload=True, peak_bytes=s.offload_peak_bytes, seconds=0.0,
                                overrides={**s.overrides, "train.cpu_offload": True},
                                note="estimate: sharded params, grads and optimizer state in host memory")
        out.append(o)
        return o

    def ranks_label(k: int) -> str:
        ws = world_size * k
        return f"{k}x ranks: {ws} ({ws / gpus_per_node:g} x {gpus_per_node} GPUs)"

    def more_ranks(prefix: str, overrides: dict[str, Any]) -> None:
        if not run(prefix + ranks_label(2), overrides, world_size * 2).fits:
            run(prefix + ranks_label(4), overrides, world_size * 4)

    ac_full = run("train.ac=full", {"train.ac": "full"}) if ac != "full" else None
    if not base.cpu_offload:
        offload_of(base, "train.cpu_offload=true")
    more_ranks("", {})
    if cfg.lora.rank == 0:
        if lora_ok:
            run("lora.rank=16 (frozen base)", {"lora.rank": 16})
        else:
            notes.append("LoRA alternative skipped: shardlm.lora is not available")
    if mb > 1:
        one = run("train.micro_batch_size=1", {"train.micro_batch_size": 1})
        if one.fits and one.measured:  # the largest micro-batch that fits: the peak is ~linear in it
            per_seq = (base.peak_bytes - one.peak_bytes) / (mb - 1)
            k = min(mb - 1, int(1 + (usable - one.peak_bytes) / per_seq)) if per_seq > 0 else mb - 1
            if k > 1:
                s = run(f"train.micro_batch_size={k}", {"train.micro_batch_size": k})
                if not s.fits and k - 1 > 1:
                    run(f"train.micro_batch_size={k - 1}", {"train.micro_batch_size": k - 1})
        notes.append("a smaller micro-batch shrinks the global batch; raising train.grad_accum to keep it costs "
                     "the unsharded gradient accumulation (see grad_accum) in this trainer")
    if not any(s.fits for s in out) and ac_full is not None:  # no single knob: combine with full AC
        full = {"train.ac": "full"}
        if not base.cpu_offload:
            measured = ac_full if ac_full.measured else run("train.ac=full", {**full, "train.cpu_offload": True},
                                                            keep=False)
            offload_of(measured, "train.ac=full + cpu_offload")
        more_ranks("train.ac=full + ", full)
        if cfg.lora.rank == 0 and lora_ok:
            run("train.ac=full + lora.rank=16", {**full, "lora.rank": 16})
        if mb > 1:
            run("train.ac=full + micro_batch_size=1", {**full, "train.micro_batch_size": 1})
    return out


__all__ = ["Breakdown", "Scenario", "PlanReport", "PlanError", "plan", "training_step",
           "warm_optimizer", "build_sharded_model", "GIB", "DEFAULT_HEADROOM"]
