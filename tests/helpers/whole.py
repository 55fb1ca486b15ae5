"""Read a parameter (or its gradient, or optimizer state) whole or locally, whether FSDP manages it (a DTensor)
or, on a mesh of one rank, leaves it a plain tensor (`shardlm.parallel.fsdp.single_copy_params`)."""

from __future__ import annotations


def whole(t):
    """The whole tensor: `full_tensor()` of a DTensor (a collective, waited for), else `t` itself.

    A tensor subclass's inner tensors are waited for here: torchao's `OptimState8bit` (8-bit optimizer state)
    all-gathers its codes and scales as two functional collectives whose outputs torch (2.11+) wraps as
    AsyncCollectiveTensors, and its slice/view ops keep them unwaited, so `full_tensor()` returns codes and
    scales that gloo may still be writing, and the collectives stay in c10d's registry until the process ends
    ("there are still N unwaited collective calls")."""
    if not hasattr(t, "full_tensor"):
        return t
    out = t.full_tensor()
    return _waited(out)


def _waited(t):
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(t, AsyncCollectiveTensor):
        return t.wait()
    if hasattr(t, "__tensor_flatten__"):
        for name in t.__tensor_flatten__()[0]:
            inner = getattr(t, name)
            waited = _waited(inner)
            if waited is not inner:
                setattr(t, name, waited)
    return t


def local(t):
    """This rank's shard: `to_local()` of a DTensor, else `t` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def whole_blocking(t):
    """The whole tensor without DTensor's functional collectives: this rank's shard as a plain tensor (a quantised
    subclass, e.g. an NF4 weight, dequantised to fp32) concatenated over each mesh dim that shards it with
    blocking c10d all_gathers (uneven pieces padded to the longest, then cut back). For the trainers' weight
    checksums: `full_tensor()` of an NF4 weight aborted natively inside its functional all-gather's wait on gloo
    in two full-suite runs (test_qlora_fsdp, 2026-12-07; the same crash class as test_optim_state_fsdp's note)."""
    import torch
    import torch.distributed as dist

    if not hasattr(t, "to_local"):
        return t
    x = t.to_local()
    if type(x) is not torch.Tensor and hasattr(x, "__tensor_flatten__"):
        x = x.to(torch.float32)
    for d, pl in enumerate(t.placements):
        if not pl.is_shard():
            continue
        group = t.device_mesh.get_group(d)
        n = dist.get_world_size(group)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(sizes, torch.tensor([x.shape[pl.dim]]), group=group)
        sizes = [int(s) for s in sizes]
        shape = list(x.shape)
        shape[pl.dim] = max(sizes)
        padded = torch.zeros(shape, dtype=x.dtype)
        padded.narrow(pl.dim, 0, x.shape[pl.dim]).copy_(x)
        pieces = [torch.empty_like(padded) for _ in range(n)]
        dist.all_gather(pieces, padded.contiguous(), group=group)
        x = torch.cat([p.narrow(pl.dim, 0, s) for p, s in zip(pieces, sizes)], dim=pl.dim)
    return x
