"""FSDP2: `fully_shard` each transformer block, then the root; shard-aware init and grad clipping."""

from __future__ import annotations

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
from torch.distributed.tensor import DTensor

from shardlm._torch_compat import compute_local_shape_and_global_offset

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GIB = 2**30


def mp_policy(param_dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    """bf16 params/compute with fp32 reduce is the usual; fp32 leaves everything in fp32; fp8 runs its
    float8 matmuls on top of bf16."""
    dtype = DTYPES["bf16" if param_dtype == "fp8" else param_dtype]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=DTYPES[reduce_dtype])


AUTO_UNSHARDED_SHARE = 0.05  # reshard_after_forward=auto: extra unsharded blocks may take this share of free memory


@dataclass(frozen=True)
class FsdpChoices:
    """What `apply_fsdp` chose, for the startup line: the last `unsharded` blocks skip the reshard after forward."""

    unsharded: int
    n_blocks: int
    reshard_reason: str
    prefetch: int

    def note(self) -> str:
        pre = "prefetch 1 (implicit)" if self.prefetch == 1 else f"prefetch {self.prefetch} (explicit)"
        return f"{self.unsharded} of {self.n_blocks} blocks unsharded after forward ({self.reshard_reason}), {pre}"


def unsharded_blocks(setting: int | bool | str, n_blocks: int, block_bytes: int, free_bytes: int | None,
                     share: float = AUTO_UNSHARDED_SHARE) -> tuple[int, str]:
    """(k, why): how many of the last blocks keep their unsharded parameters from forward to backward.

    Their backward then needs no all-gather. true = 1 (the last block: backward needs it at once);
    false = every block (ZeRO-2); N = N; auto = as many as fit in `share` of `free_bytes` (the device's
    free memory before the model is materialised), at least 1; `free_bytes` None (CPU, CPU offload) = 1.
    """
    if setting is True or setting is False:
        return (1, "true: every block but the last resharded") if setting else (n_blocks, "false: ZeRO-2")
    if setting != "auto":
        k = min(int(setting), n_blocks)
        return k, f"parallel.reshard_after_forward={setting}"
    if free_bytes is None:
        return 1, "auto: every block but the last resharded off GPUs and under CPU offload"
    budget, gib = int(share * free_bytes), block_bytes / GIB
    fit = budget // max(block_bytes, 1)
    k = max(1, min(n_blocks, fit))
    room = f"{share:.0%} of {free_bytes / GIB:.1f} GiB free"
    if fit < 1:
        return k, f"auto: one block's {gib:.2f} GiB exceeds {room}: only the last block kept"
    return k, f"auto: {'all ' if k == n_blocks else ''}{k} x {gib:.2f} GiB within {room}"


def block_param_bytes(block: nn.Module, mp: MixedPrecisionPolicy) -> int:
    """Bytes of one block's unsharded parameters as FSDP all-gathers them (in mp.param_dtype)."""
    def size(p: torch.Tensor) -> int:
        dtype = mp.param_dtype if mp.param_dtype is not None and p.is_floating_point() else p.dtype
        return p.numel() * dtype.itemsize
    return sum(size(p) for p in block.parameters())


def free_device_bytes(mesh: DeviceMesh, cpu_offload: bool) -> int | None:
    """The least free accelerator memory of any rank now (a collective); None on CPU and under CPU offload."""
    if mesh.device_type != "cuda" or cpu_offload:
        return None
    free = torch.tensor(torch.cuda.mem_get_info(torch.cuda.current_device())[0], dtype=torch.int64, device="cuda")
    if dist.is_initialized():  # every rank must choose the same k: a rank that reshards waits on the others
        dist.all_reduce(free, op=dist.ReduceOp.MIN)
    return int(free.item())


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, mp: MixedPrecisionPolicy,
               reshard_after_forward: int | bool | str = True, cpu_offload: bool = False,
               prefetch: int = 1, free_bytes: int | None = None) -> FSDPModule:
    """Shard every block of `model.layers` as its own unit, then the root (embeddings, norm, head).

    The last k blocks keep their parameters after forward (`unsharded_blocks`; k = 1 by default):
    backward needs them first, so resharding them would only cost an extra all-gather. `prefetch` > 1
    all-gathers the next N blocks ahead (forward) and the previous N (backward) instead of FSDP's
    implicit one. With `cpu_offload` the sharded parameters, gradients and optimizer state live in
    (pinned) host memory between uses. `free_bytes` stands in for the devices' free memory under
    reshard_after_forward=auto (tests; the planner resolves auto to a number with `unsharded_blocks`).
    The choices are recorded on `model.fsdp_choices` (the startup line prints them).
    """
    # Pinned host memory makes the H2D copies async; there is nothing to pin for without an accelerator.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    blocks = list(model.layers)
    n = len(blocks)
    if free_bytes is None and reshard_after_forward == "auto" and n:
        free_bytes = free_device_bytes(mesh, cpu_offload)
    k, why = unsharded_blocks(reshard_after_forward, n, block_param_bytes(blocks[0], mp) if n else 0,
                              None if cpu_offload else free_bytes)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=i < n - k)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload,
                reshard_after_forward=reshard_after_forward is not False)
    set_prefetch(blocks, prefetch)
    model.fsdp_choices = FsdpChoices(k, n, why, prefetch)
    return model  # type: ignore[return-value]


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


def shard_view(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(local tensor, global index of its first row) of a dim-0 sharded DTensor, or (p, 0)."""
    if not isinstance(p, DTensor):
        return p, 0
    local, _, offset = shard_region(p)
    return local, (offset[0] if offset else 0)


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
