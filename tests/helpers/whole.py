"""Read a parameter (or its gradient, or optimizer state) whole or locally, whether FSDP manages it (a DTensor)
or, on a mesh of one rank, leaves it a plain tensor (`shardlm.parallel.fsdp.single_copy_params`).

Tests never read a DTensor whole through `full_tensor()`: on gloo its functional all-gathers aborted a rank
natively (glibc heap checks: "malloc(): unaligned tcache chunk", "free(): invalid pointer", inside
`wait_tensor` or `_maybe_unpad_tensor`) in about one full-suite run in three, in test_optim_state_fsdp (4
sightings, plain bf16 moments included) and test_qlora_fsdp (NF4 weights), never when a module ran alone.
`whole()` gathers with blocking c10d all_gathers instead (same bytes: pieces concatenated in shard order).
shardlm itself never gathers a tensor whole (no `full_tensor()` in src/)."""

from __future__ import annotations


def whole(t):
    """The whole tensor, in its own dtype: a DTensor's shards gathered with blocking c10d collectives, else `t`.
    A quantised subclass (an NF4 weight, torchao's 8-bit optimizer state) is refused: say how to read it
    (`whole_blocking` dequantises; the 8-bit moments' codes and scales are plain tensors)."""
    import torch

    if not hasattr(t, "to_local"):
        return t
    if type(t.to_local()) is not torch.Tensor:
        raise TypeError(f"whole() reads plain DTensors; this one holds a {type(t.to_local()).__name__}: "
                        "use whole_blocking() (dequantised) or gather its inner tensors")
    return whole_blocking(t)


def local(t):
    """This rank's shard: `to_local()` of a DTensor, else `t` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def whole_blocking(t):
    """The whole tensor without DTensor's functional collectives: this rank's shard as a plain tensor (a quantised
    subclass, e.g. an NF4 weight, dequantised to fp32) concatenated over each mesh dim that shards it with
    blocking c10d all_gathers (uneven pieces padded to the longest, then cut back)."""
    import torch
    import torch.distributed as dist

    if not hasattr(t, "to_local"):
        return t
    assert not any(pl.is_partial() for pl in t.placements), t.placements
    x = t.to_local().detach()
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
