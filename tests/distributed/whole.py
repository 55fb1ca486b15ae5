"""Read a parameter (or its gradient, or optimizer state) whole or locally, whether FSDP manages it (a DTensor)
or, on a mesh of one rank, leaves it a plain tensor (`shardlm.parallel.fsdp.single_copy_params`)."""

from __future__ import annotations


def whole(t):
    """The whole tensor: `full_tensor()` of a DTensor (a collective), else `t` itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local(t):
    """This rank's shard: `to_local()` of a DTensor, else `t` itself."""
    return t.to_local() if hasattr(t, "to_local") else t
