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
