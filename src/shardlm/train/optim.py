"""AdamW over trainable parameters (moments in fp32, bf16 or torchao's 8-bit blocks), and the warmup + decay
learning-rate schedule.

train.optimizer_state_dtype picks where the two AdamW moments (exp_avg, exp_avg_sq) live; the parameters
(FSDP2's sharded fp32 master weights) and the update's arithmetic stay fp32 in every case:

* fp32: torch.optim.AdamW, fused kernels on CUDA. 8 bytes of state per trainable parameter.
* bf16: `AdamWBF16State`, each moment rounded to bf16 after an fp32 update. 4 bytes per parameter.
* int8: `AdamWInt8State`, torchao's 8-bit AdamW state (`OptimState8bit`: a uint8 code per value + one fp32
  scale per 256-value block, dynamic-tree quantisation after Dettmers et al.) and its update function
  (`torchao.optim.adam.single_param_adam`). ~2.03 bytes per parameter. As in torchao (and bitsandbytes),
  tensors under 4096 values (norm weights, small biases) keep fp32 moments.

Why our own shell around torchao's 8-bit state instead of `torchao.optim.AdamW8bit` itself: AdamW8bit
decides per *local shard* whether to quantise (>= 4096 values and a multiple of the block) and lays its
blocks over the shard, so the state would change with the number of ranks; it wants the LR as a tensor
(the schedule writes floats); and it always runs the update through torch.compile (20 s per shape on a CPU).
Here the decision is made on the whole parameter, a sharding whose shards are not whole blocks is refused
(`check_int8_shards`), and the update is compiled on CUDA only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from shardlm._torch_compat import dynamo_no_cache_limit
from shardlm.checkpoint.lineage import RunFacts
from shardlm.config import TrainSection
from shardlm.errors import ConfigError
from shardlm.extras import require

INT8_BLOCK = 256  # torchao AdamW8bit's default: one fp32 scale per 256 values
INT8_MIN_NUMEL = 4096  # torchao / bitsandbytes: smaller tensors keep fp32 moments


def build_optimizer(model: nn.Module, t: TrainSection, device: torch.device) -> torch.optim.Optimizer:
    """AdamW with decay on matrices only (not norms or biases), its moments in train.optimizer_state_dtype.
    Fused kernels on CUDA for fp32. Built after sharding (int8 checks the shards here)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [{**g, "state_dtype": t.optimizer_state_dtype} for g in groups if g["params"]]
    kw = dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    if t.optimizer_state_dtype == "bf16":
        opt = AdamWBF16State(groups, **kw)
    elif t.optimizer_state_dtype == "int8":
        _torchao_optim()  # one clear line when torchao is missing, before anything runs
        check_int8_shards((n, p) for n, p in model.named_parameters() if p.requires_grad)
        opt = AdamWInt8State(groups, **kw)
    else:
        opt = torch.optim.AdamW(groups, **kw, fused=device.type == "cuda")
    _track_resumed_state_dtype(opt, t.optimizer_state_dtype)
    return opt


def _track_resumed_state_dtype(opt: torch.optim.Optimizer, dtype: str) -> None:
    """A checkpoint saved under another train.optimizer_state_dtype loads by conversion (DCP copies the saved
    moments into this run's: rounded to bf16, quantised to 8 bits, or widened). Keep this run's dtype in the
    param groups (the load replaces them with the saved ones) and leave the saved one in
    `opt.resumed_state_dtype` for the trainer to report."""
    opt.resumed_state_dtype = None

    def before(o, state_dict):
        groups = state_dict.get("param_groups") or [{}]
        o.resumed_state_dtype = groups[0].get("state_dtype", "fp32")  # older checkpoints: fp32 AdamW

    def after(o):
        for g in o.param_groups:
            g["state_dtype"] = dtype

    opt.register_load_state_dict_pre_hook(before)
    opt.register_load_state_dict_post_hook(after)


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if hasattr(x, "to_local") else x


class LowPrecisionStateAdamW(torch.optim.AdamW):
    """torch.optim.AdamW's update, one parameter at a time in fp32, with the moments stored by `_zeros`.

    Works on FSDP2's DTensor parameters (the math runs on the local shards: it is elementwise) and on
    plain tensors (the planner's local shards). group["lr"] may be a float (the trainer's LR schedule
    writes one) or a tensor. The state is {"step": 0-d fp32 tensor, "exp_avg", "exp_avg_sq"}, as
    torch's AdamW: `get_state_dict`/DCP save, load and reshard it like AdamW's.
    """

    moment_dtype: torch.dtype | None = None  # what load_state_dict must hand back (None: whatever _zeros made)

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        # Optimizer.load_state_dict casts every loaded moment to its parameter's dtype (fp32): cast them back,
        # or a resumed run would go on with (and hold) fp32 moments.
        self.register_load_state_dict_post_hook(type(self)._restore_moment_dtype)

    def _restore_moment_dtype(self) -> None:
        for state in self.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                if self.moment_dtype is not None and k in state and state[k].dtype != self.moment_dtype:
                    state[k] = state[k].to(self.moment_dtype)

    def _zeros(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        raise NotImplementedError

    def init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state of `p` before its first step (zero moments)."""
        return {"step": torch.tensor(0.0), "exp_avg": self._zeros(p, True), "exp_avg_sq": self._zeros(p, False)}

    def _update(self, p, grad, step, exp_avg, exp_avg_sq, lr, beta1, beta2, weight_decay, eps) -> None:
        """One AdamW update of `p` (local tensors): fp32 math, moments written back at their precision."""
        g = grad.float()
        m = exp_avg.to(torch.float32, copy=True).lerp_(g, 1 - beta1)  # fp32 copies: the update uses them unrounded
        v = exp_avg_sq.to(torch.float32, copy=True).mul_(beta2).addcmul_(g, g, value=1 - beta2)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
        # bias corrections as 0-d tensors: no host read of `step` (none is possible on fake tensors)
        denom = v.sqrt_().div_((1 - beta2 ** step).sqrt()).add_(eps)
        p.mul_(1 - lr * weight_decay)
        p.addcdiv_(m.mul_(-lr / (1 - beta1 ** step)), denom)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self.init_state(p))
                state["step"] += 1
                self._update(_local(p), _local(p.grad), state["step"], _local(state["exp_avg"]),
                             _local(state["exp_avg_sq"]), group["lr"], beta1, beta2, group["weight_decay"],
                             group["eps"])
        return loss


class AdamWBF16State(LowPrecisionStateAdamW):
    """AdamW with bf16 moments (round-to-nearest after each fp32 update) and fp32 parameters: half the state
    bytes of torch.optim.AdamW. The parameters, gradients and the update itself stay fp32."""

    moment_dtype = torch.bfloat16

    def _zeros(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        return torch.zeros_like(p, dtype=torch.bfloat16)


def _torchao_optim():
    """torchao.optim (one ConfigError line when missing or too old), its 8-bit code tables built."""
    from concurrent.futures import ThreadPoolExecutor

    def load():
        mod = require("torchao.optim", "fp8", "train.optimizer_state_dtype=int8")
        from torchao.optim import subclass_8bit

        for table in ("get_qmap_signed", "get_qmap_unsigned"):  # lazy in torchao 0.18; built at import before
            getattr(subclass_8bit, table, lambda: None)()
        return mod

    # torchao builds its code tables from tensors and caches them as floats. Under the planner's FakeTensorMode
    # that build cannot read values; dispatch modes are per thread, so import and build on a fresh thread.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(load).result()


def _shard_numels(p: torch.Tensor) -> list[int]:
    """The number of values of `p` on each rank: FSDP2 splits dim 0 into torch.chunk's pieces (ceil(rows /
    shards) rows each, the last ones shorter or empty); a replicated mesh dimension does not split."""
    if not hasattr(p, "placements"):
        return [p.numel()]
    parts = 1
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_shard():
            if placement.dim != 0:
                raise ConfigError(f"train.optimizer_state_dtype=int8 supports parameters sharded on dim 0 (FSDP2), "
                                  f"not {p.placements}; use train.optimizer_state_dtype=bf16")
            parts *= p.device_mesh.size(mesh_dim)
    rows = p.shape[0] if p.ndim else 1
    chunk, row = -(-rows // parts), p.numel() // max(rows, 1)
    return [min(chunk, max(rows - k * chunk, 0)) * row for k in range(parts)]


def int8_quantised(p: torch.Tensor) -> bool:
    """Whether `p`'s moments are 8-bit: torchao's rule (>= 4096 values, whole 256-value blocks), applied to
    the whole parameter, so that it does not depend on the number of ranks."""
    return p.numel() >= INT8_MIN_NUMEL and p.numel() % INT8_BLOCK == 0


def check_int8_shards(named_params: Iterator[tuple[str, torch.Tensor]]) -> None:
    """ConfigError unless every 8-bit parameter's shards are whole 256-value blocks.

    Then each block lies in one rank's shard, the state is the same on any number of ranks (the blocks of
    the whole tensor) and DCP can reshard it (torchao slices it on block boundaries only). Always true when
    the row length (e.g. model.dim) is a multiple of 256; for other rows the rows per shard must make up
    whole blocks.
    """
    for name, p in named_params:
        if not int8_quantised(p):
            continue
        sizes = _shard_numels(p)
        if any(n % INT8_BLOCK for n in sizes):
            row = p.numel() // p.shape[0]
            need = INT8_BLOCK // math.gcd(row, INT8_BLOCK)
            raise ConfigError(
                f"train.optimizer_state_dtype=int8: {name} {tuple(p.shape)} splits over {len(sizes)} data-parallel "
                f"shards into {sorted(set(sizes), reverse=True)} values, not whole {INT8_BLOCK}-value quantisation "
                f"blocks (the 8-bit state would depend on the number of ranks); use a dp_shard that gives each rank a "
                f"multiple of {need} of its {p.shape[0]} rows, or train.optimizer_state_dtype=bf16")


class AdamWInt8State(LowPrecisionStateAdamW):
    """AdamW with torchao's 8-bit moments (`OptimState8bit`, 256-value blocks) and its update function,
    `torchao.optim.adam.single_param_adam` (fp32 math; compiled on CUDA as AdamW8bit does, eager elsewhere).
    Parameters below 4096 values keep fp32 moments. See the module docstring for why not AdamW8bit itself."""

    def _zeros(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        from torchao.optim.subclass_8bit import OptimState8bit

        local = _local(p)
        if int8_quantised(p):
            out = OptimState8bit.zeros(local.shape, signed, INT8_BLOCK, local.device, dtype=local.dtype)
        else:
            out = torch.zeros_like(local)
        if hasattr(p, "placements"):  # shards may differ in shape: give the global shape and stride
            from torch.distributed.tensor import DTensor

            out = DTensor.from_local(out, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                     stride=p.stride())
        return out.to(p.device)  # from_local moves to the mesh's device type; CPU offload keeps it on the CPU

    def _update(self, p, grad, step, exp_avg, exp_avg_sq, lr, beta1, beta2, weight_decay, eps) -> None:
        from torchao.optim.adam import single_param_adam

        fn = single_param_adam
        if p.device.type == "cuda":
            fn = _compiled_single_param_adam()
        fn(p, grad, step, exp_avg, exp_avg_sq, None, torch.as_tensor(lr, dtype=torch.float32), beta1, beta2,
           weight_decay, eps, True, False)


_COMPILED = None


def _compiled_single_param_adam():
    """torchao's update under torch.compile (one graph per shape, as AdamW8bit: no recompile limit)."""
    global _COMPILED
    if _COMPILED is None:
        from torchao.optim.adam import single_param_adam

        compiled = torch.compile(single_param_adam, fullgraph=True, dynamic=False)
        no_limit = dynamo_no_cache_limit()

        def run(*args):
            if no_limit is None:
                return compiled(*args)
            with no_limit():
                return compiled(*args)
        _COMPILED = run
    return _COMPILED


STATE_CLASSES = {"bf16": AdamWBF16State, "int8": AdamWInt8State}


def adopt_state_dtype(optimizer: torch.optim.Optimizer) -> LowPrecisionStateAdamW | None:
    """Give an AdamW built over `build_optimizer`'s groups (the planner's, over local shards) the class
    train.optimizer_state_dtype picks, in place; returns it, or None for fp32 (nothing to change)."""
    dtype = optimizer.param_groups[0].get("state_dtype", "fp32") if optimizer.param_groups else "fp32"
    if dtype == "fp32":
        return None
    optimizer.__class__ = STATE_CLASSES[dtype]
    patch = getattr(optimizer, "_patch_step_function", None)  # private (torch 2.0 - 2.13): puts the step hooks
    if patch is not None:  # (the memory tracker's) on the new class's step, as Optimizer.__init__ does
        patch()
    return optimizer


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state on this rank (local shards; an 8-bit moment: its codes, scales and code table)."""

    def size(t: torch.Tensor) -> int:
        t = _local(t)
        if hasattr(t, "__tensor_flatten__"):  # a tensor subclass (torchao's OptimState8bit): its inner tensors
            return sum(size(getattr(t, a)) for a in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()

    return sum(size(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))


Anchor = tuple[int, float]  # (step, factor): the decay restarts from `factor` at `step`


def lr_factor(step: int, t: TrainSection, anchor: Anchor | None = None) -> float:
    """Multiplier of train.lr for optimizer step `step` (0-based).

    Warmup, then decay from 1 to train.min_lr_ratio at train.steps. With an `anchor` (a resume that changed
    train.steps) the decay from the anchor step on runs from the anchor's factor to min_lr_ratio at the new
    train.steps instead, so the learning rate goes on from where it was and never jumps back up.
    """
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return 1.0
    start, top = (t.warmup_steps, 1.0) if anchor is None or step < anchor[0] else anchor
    progress = min((step - start) / max(t.steps - start, 1), 1.0)
    if t.lr_schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.min_lr_ratio + (top - t.min_lr_ratio) * shape


def extended_anchor(step: int, t: TrainSection, saved_steps: int, saved: Anchor | None) -> Anchor | None:
    """The anchor for a run resumed at `step` whose checkpoint was saved under train.steps=`saved_steps`:
    unchanged steps keep the saved anchor; changed ones anchor at `step`, at the factor the saved schedule
    had reached (None during warmup: warmup does not depend on train.steps)."""
    if saved_steps == t.steps or step < t.warmup_steps or t.lr_schedule == "constant":
        return saved
    return step, lr_factor(step, dataclasses.replace(t, steps=saved_steps), saved)


def resume_anchor(facts: RunFacts, step: int, t: TrainSection, global_batch: int, world_size: int,
                  log: Callable[[str], None]) -> Anchor | None:
    """The schedule's anchor for a run resumed at `step` from a checkpoint with these run facts (RunFacts);
    what changed since (the global batch, train.steps) is said in a line."""
    if facts.global_batch not in (None, global_batch):
        log(f"resume: the global batch changes from {facts.global_batch} to {global_batch} sequences "
            f"({facts.world_size} -> {world_size} ranks x train.micro_batch_size={t.micro_batch_size} x "
            f"grad_accum={t.grad_accum}); the data goes on where it stopped, the LR schedule counts optimizer steps "
            "as before")
    if facts.schedule is None:
        return None
    saved_steps = facts.schedule.steps
    anchor = extended_anchor(step, t, saved_steps, facts.schedule.anchor)
    if saved_steps != t.steps:
        log(f"resume: train.steps {saved_steps} -> {t.steps}: the learning rate goes on from "
            f"{t.lr * lr_factor(step, t, anchor):.3g} at step {step} and decays to {t.lr * t.min_lr_ratio:.3g} at "
            f"step {t.steps} (no jump back up)")
    return anchor


class LRSchedule:
    """train.lr x `lr_factor(step)` written into every param group before each optimizer step (as nanoGPT
    does): the position is one integer, the number of optimizer steps done, so a resume (also one that
    changed train.lr or train.steps) continues the schedule it describes."""

    def __init__(self, opt: torch.optim.Optimizer, t: TrainSection, step: int = 0, anchor: Anchor | None = None):
        self.opt, self.t, self.anchor = opt, t, anchor
        self.set(step)

    def set(self, step: int) -> None:
        self.last_epoch = step  # the name torch's schedulers use for the same number
        for group in self.opt.param_groups:
            group["lr"] = self.t.lr * lr_factor(step, self.t, self.anchor)

    def step(self) -> None:
        """One optimizer step was applied (a skipped non-finite step is not one)."""
        self.set(self.last_epoch + 1)

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.opt.param_groups]


def build_lr_scheduler(opt: torch.optim.Optimizer, t: TrainSection, last_step: int = 0,
                       anchor: Anchor | None = None) -> LRSchedule:
    """The schedule positioned at `last_step` optimizer steps done (0 = fresh; > 0 after a resume)."""
    return LRSchedule(opt, t, last_step, anchor)
