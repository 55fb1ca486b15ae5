"""Checkpoints: sharded DCP save/load (manager) and the files beside the tensors (meta)."""

from shardlm.checkpoint.manager import (
    Checkpointer,
    SafeLoadPlanner,
    complete_checkpoints,
    read_keys,
    step_of,
)

__all__ = ["Checkpointer", "SafeLoadPlanner", "complete_checkpoints", "read_keys", "step_of"]
