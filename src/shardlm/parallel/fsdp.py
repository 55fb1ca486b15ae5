"""FSDP2: `fully_shard` each transformer block, then the root; shard-aware init and grad clipping."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Shard

from shardlm._torch_compat import compute_local_shape_and_global_offset
from shardlm.models.llama import OutputHead
from shardlm.models.moe import Experts
from shardlm.quant.nf4 import is_nf4

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GIB = 2**30


def mp_policy(param_dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    """bf16 params/compute with fp32 reduce is the usual; fp32 leaves everything in fp32; fp8 runs its
    float8 matmuls on top of bf16."""
    dtype = DTYPES["bf16" if param_dtype == "fp8" else param_dtype]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=DTYPES[reduce_dtype])


AUTO_HEADROOM = 0.10  # reshard_after_forward=auto leaves this share of the device free (the planner's headroom)


@dataclass(frozen=True)
class FsdpChoices:
    """What `apply_fsdp` chose, for the startup line: the last `unsharded` blocks skip the reshard after forward.

    `pending_auto`: reshard_after_forward=auto, not decided yet (the run decides after its second step,
    `settle_auto_reshard`); `block_bytes`: one block's unsharded parameters; `single_copy`: parameters left
    to the module on a mesh of one rank (no sharded copy beside an unsharded one; see `single_copy_params`)."""

    unsharded: int
    n_blocks: int
    reshard_reason: str
    prefetch: int
    block_bytes: int = 0
    pending_auto: bool = False
    single_copy: int = 0

    def note(self) -> str:
        pre = "prefetch 1 (implicit)" if self.prefetch == 1 else f"prefetch {self.prefetch} (explicit)"
        one = f", {self.single_copy} parameters unwrapped on one rank (one copy)" if self.single_copy else ""
        return f"{self.unsharded} of {self.n_blocks} blocks unsharded after forward ({self.reshard_reason}), {pre}{one}"


def unsharded_blocks(setting: int | bool | str, n_blocks: int, block_bytes: int, spare_bytes: int | None) \
        -> tuple[int, str]:
    """(k, why): how many of the last blocks keep their unsharded parameters from forward to backward.

    Their backward then needs no all-gather. true = 1 (the last block: backward needs it at once);
    false = every block (ZeRO-2); N = N; auto = 1, plus as many more as fit in `spare_bytes`: the memory that
    stays free at the peak of a step with 1 (less `AUTO_HEADROOM` of the device), so auto never needs memory
    that `true` would not leave free. `spare_bytes` None: not known yet (before the run's second step), or
    there is none to use (CPU, CPU offload) = 1.
    """
    if setting is True or setting is False:
        return (1, "true: every block but the last resharded") if setting else (n_blocks, "false: ZeRO-2")
    if setting != "auto":
        k = min(int(setting), n_blocks)
        return k, f"parallel.reshard_after_forward={setting}"
    if spare_bytes is None:
        return 1, "auto: the last block; on GPUs more after step 2, in memory left free at its peak"
    gib = block_bytes / GIB
    extra = max(0, spare_bytes) // max(block_bytes, 1)
    k = min(n_blocks, 1 + extra)
    room = f"{max(0, spare_bytes) / GIB:.1f} GiB free at the peak less {AUTO_HEADROOM:.0%} of the device"
    if extra < 1:
        return k, f"auto: no block of {gib:.2f} GiB fits in the {room}: only the last block kept"
    return k, f"auto: {'all ' if k == n_blocks else ''}{k} x {gib:.2f} GiB blocks, the {k - 1} extra within the {room}"


def block_param_bytes(block: nn.Module, mp: MixedPrecisionPolicy, skip: set[nn.Parameter] = frozenset()) -> int:
    """Bytes of one block's unsharded parameters as FSDP all-gathers them (in mp.param_dtype), but for those in
    `skip` (left to the module: `single_copy_params`)."""
    def size(p: torch.Tensor) -> int:
        dtype = mp.param_dtype if mp.param_dtype is not None and p.is_floating_point() else p.dtype
        return p.numel() * dtype.itemsize
    return sum(size(p) for p in block.parameters() if p not in skip)


def spare_device_bytes(mesh: DeviceMesh, cpu_offload: bool, headroom: float = AUTO_HEADROOM) -> int | None:
    """What stayed free at this process's peak so far, less `headroom` of the device: the least over every rank
    (a collective); None on CPU and under CPU offload.

    The peak is the caching allocator's (`max_memory_reserved`); what the allocator does not hold (the CUDA
    context, NCCL's buffers, other processes) is read from the device as it is now."""
    if mesh.device_type != "cuda" or cpu_offload:
        return None
    dev = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(dev)
    outside = total - free - torch.cuda.memory_reserved(dev)
    spare = int(total * (1 - headroom)) - outside - torch.cuda.max_memory_reserved(dev)
    t = torch.tensor(spare, dtype=torch.int64, device="cuda")
    if dist.is_initialized():  # every rank must choose the same k: a rank that reshards waits on the others
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def single_copy_params(model: nn.Module, world: int, mp: MixedPrecisionPolicy, cpu_offload: bool) \
        -> set[nn.Parameter]:
    """The parameters FSDP should leave alone on a mesh of one rank: there its "all-gather" would only copy the
    one shard into a second, unsharded buffer. Those already stored in the compute dtype (a frozen bf16 base
    under bf16, everything under fp32) and NF4 ones run as they are; the rest (fp32 master weights under bf16)
    stay with FSDP, whose copy is then the bf16 cast every mixed-precision scheme makes. Nothing is left alone
    with CPU offload (FSDP moves what it manages) or on more than one rank."""
    if world != 1 or cpu_offload:
        return set()
    compute = mp.param_dtype
    return {p for p in model.parameters() if is_nf4(p) or compute is None or p.dtype == compute}


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, mp: MixedPrecisionPolicy,
               reshard_after_forward: int | bool | str = True, cpu_offload: bool = False,
               prefetch: int = 1, spare_bytes: int | None = None) -> FSDPModule:
    """Shard every block of `model.layers` as its own unit, the untied embedding and head as theirs, then the root.

    The last k blocks keep their parameters after forward (`unsharded_blocks`; k = 1 by default):
    backward needs them first, so resharding them would only cost an extra all-gather. With an untied head
    (`OutputHead`), the embedding is a unit of its own (freed after its forward, gathered again for its backward
    at the very end) and so is the head (kept from its forward to its backward, which comes first, then freed):
    neither is held while the blocks run backward (torchtitan's and torchtune's split; the root held both all
    step: 2 x vocab x dim in the compute dtype, 3.9 GiB for Llama-3-70B). A tied or LoRA-adapted head stays in
    the root with the embedding, whose parameters torch keeps from forward to backward.

    `prefetch` > 1 all-gathers the next N blocks ahead (forward) and the previous N (backward) instead of
    FSDP's implicit one. With `cpu_offload` the sharded parameters, gradients and optimizer state live in
    (pinned) host memory between uses. Under reshard_after_forward=auto, `spare_bytes` stands in for the memory
    the run finds free at its peak (tests; a run calls `settle_auto_reshard`). On a mesh of one rank, FSDP
    leaves the `single_copy_params` alone. The choices are recorded on `model.fsdp_choices` (the startup line
    prints them).
    """
    # Pinned host memory makes the H2D copies async; there is nothing to pin for without an accelerator.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    blocks = list(model.layers)
    n = len(blocks)
    ignored = single_copy_params(model, mesh.size(), mp, cpu_offload)
    block_bytes = block_param_bytes(blocks[0], mp, ignored) if n else 0
    k, why = unsharded_blocks(reshard_after_forward, n, block_bytes, None if cpu_offload else spare_bytes)
    pending = reshard_after_forward == "auto" and spare_bytes is None
    if pending and (cpu_offload or mesh.device_type != "cuda"):
        pending, why = False, f"auto: the last block ({'CPU offload' if cpu_offload else 'no GPU'}: no device memory to use)"
    extra = {"ignored_params": ignored} if ignored else {}
    placement = expert_placement(model, mesh.size(mesh.ndim - 1))
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=i < n - k,
                    **extra, **({"shard_placement_fn": placement} if placement else {}))
    if isinstance(getattr(model, "lm_head", None), OutputHead):  # untied: embedding and head need not live all step
        # the embedding runs first in forward and last in backward: freed in between (gathered again at the end)
        fully_shard(model.embed_tokens, mesh=mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward is not False, **extra)
        # the head (and the loss, in its one call) runs last in forward and first in backward: kept to its
        # backward, then freed before the blocks' backward
        fully_shard(model.lm_head, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False,
                    **extra)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, **extra)
    set_prefetch(blocks, prefetch)
    model.fsdp_choices = FsdpChoices(k, n, why, prefetch, block_bytes, pending, len(ignored))
    return model  # type: ignore[return-value]


def expert_placement(model: nn.Module, shard_size: int):
    """fully_shard's `shard_placement_fn` for a mixture of experts sharded over more ranks than it has experts,
    else None. Stacked experts shard on dim 0 (by expert) by default; with fewer experts than ranks (Mixtral's 8 on
    16+ GPUs) dim 0 would leave ranks holding padding and every all-gather `shard_size` experts long, so each
    stacked parameter (and its LoRA factors) shards on its largest other dim instead, as torchtitan does."""
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if not experts or shard_size <= experts[0].n_experts:
        return None
    ids = {id(p) for m in experts for p in m.parameters()}

    def placement(p: nn.Parameter) -> Shard | None:
        if id(p) not in ids:
            return None
        return Shard(max(range(1, p.ndim), key=lambda d: p.shape[d]))

    return placement


def keep_unsharded(model: nn.Module, k: int) -> None:
    """From the next forward on, the last `k` blocks keep their unsharded parameters until their backward (the
    others reshard after forward). Changes which all-gathers run, never what is computed."""
    blocks = list(model.layers)
    for i, block in enumerate(blocks):
        block.set_reshard_after_forward(i < len(blocks) - k, recurse=False)


def settle_auto_reshard(model: nn.Module, mesh: DeviceMesh, cpu_offload: bool) -> str | None:
    """parallel.reshard_after_forward=auto, once the run's peak is known (after its second step: the optimizer
    state then exists): keep as many more of the last blocks unsharded as fit in what stayed free
    (`spare_device_bytes`, the same on every rank). Returns the line to log, or None when there was nothing
    to decide (not auto, decided already, CPU)."""
    ch: FsdpChoices | None = getattr(model, "fsdp_choices", None)
    if ch is None or not ch.pending_auto:
        return None
    spare = spare_device_bytes(mesh, cpu_offload)
    model.fsdp_choices = dataclasses.replace(ch, pending_auto=False)
    if spare is None:
        return None
    k, why = unsharded_blocks("auto", ch.n_blocks, ch.block_bytes, spare)
    if k > ch.unsharded:
        keep_unsharded(model, k)
    model.fsdp_choices = dataclasses.replace(model.fsdp_choices, unsharded=k, reshard_reason=why)
    return f"parallel.reshard_after_forward=auto after step 2: {k} of {ch.n_blocks} blocks unsharded after forward ({why})"


def set_prefetch(blocks: list[nn.Module], n: int) -> None:
    """Explicit prefetch of the next `n` blocks in forward and the previous `n` in backward (n > 1); the
    order of the all-gathers changes, not what is computed."""
    if n <= 1:
        return
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + n])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - n):i][::-1])


def shard_region(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, its shape, its offset in the global tensor) of a DTensor, or of a plain tensor."""
    if not isinstance(p, DTensor):
        return p.data, tuple(p.shape), (0,) * p.ndim
    local = p.to_local()
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard of shape {tuple(local.shape)} where the placements say {tuple(shape)}")
    return local, tuple(shape), tuple(offset)


def shard_view(p: torch.Tensor) -> tuple[torch.Tensor, int | tuple[int, ...]]:
    """(local tensor, global index of its first row) of a dim-0 sharded DTensor, or (p, 0); for a shard along
    another dim (`expert_placement`), (local tensor, its offset in every dim)."""
    if not isinstance(p, DTensor):
        return p, 0
    local, shape, offset = shard_region(p)
    if not offset:
        return local, 0
    return (local, offset[0]) if tuple(shape[1:]) == tuple(p.shape[1:]) else (local, tuple(offset))


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, flag: torch.Tensor | None = None) -> torch.Tensor:
    """Global L2 norm of the (sharded) gradients in ONE all-reduce, clipping them to `max_norm` when > 0.

    Each rank squares the norm of its local shards; the sum over all ranks, divided by the number
    of replicas of each shard (HSDP), is the squared global norm. `flag` (the trainer passes its
    local loss sum) rides on the same all-reduce as `flag * 0`: a NaN or inf on any rank makes the
    norm NaN on every rank, so the non-finite guard needs no collective of its own.
    """
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = local[0].device if local else (flag.device if flag is not None else torch.device("cpu"))
    sq = torch.nn.utils.get_total_norm(local, norm_type=2.0, foreach=True).to(torch.float32) ** 2 if local \
        else torch.zeros((), device=device)
    if flag is not None:
        sq = sq + flag.to(sq.device) * 0
    sharded = next((g for g in grads if isinstance(g, DTensor)), None)
    if sharded is not None and dist.is_initialized():
        dist.all_reduce(sq)
        replicas = math.prod(sharded.device_mesh.size(i) for i, pl in enumerate(sharded.placements)
                             if pl.is_replicate())
        sq = sq / replicas
    norm = sq.sqrt()
    if max_norm > 0 and local:
        torch.nn.utils.clip_grads_with_norm_(local, max_norm, norm, foreach=True)
    return norm
