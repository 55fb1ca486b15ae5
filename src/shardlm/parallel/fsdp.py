"""FSDP2: `fully_shard` each transformer block, then the root; shard-aware init and grad clipping."""

from __future__ import annotations

import math

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


def mp_policy(param_dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    """bf16 params/compute with fp32 reduce is the usual; fp32 leaves everything in fp32; fp8 runs its
    float8 matmuls on top of bf16."""
    dtype = DTYPES["bf16" if param_dtype == "fp8" else param_dtype]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=DTYPES[reduce_dtype])


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, mp: MixedPrecisionPolicy,
               reshard_after_forward: bool = True, cpu_offload: bool = False) -> FSDPModule:
    """Shard every block of `model.layers` as its own unit, then the root (embeddings, norm, head).

    The last block keeps its parameters after forward: backward needs them at once, so
    resharding would only cost an extra all-gather. With `cpu_offload` the sharded parameters,
    gradients and optimizer state live in (pinned) host memory between uses.
    """
    # Pinned host memory makes the H2D copies async; there is nothing to pin for without an accelerator.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    blocks = list(model.layers)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard_after_forward)
    return model  # type: ignore[return-value]


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
