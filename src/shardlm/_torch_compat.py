"""Every private torch access shardlm makes, in one place, each with the torch versions it was checked on.

A torch upgrade means reviewing this file (and running the suite): nothing else in shardlm imports
a private torch name or reads a private attribute of a torch object. Checked on torch 2.11 and 2.13
(CI runs 2.13; the GPU machine 2.11) unless a line says otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

# -- DTensor: the global offset of a rank's shard (shard-invariant init, per-rank HF reads).
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: F401

# -- DCP: put a loaded non-tensor value back into a nested state dict (SafeLoadPlanner).
from torch.distributed.checkpoint._traverse import set_element  # noqa: F401

# -- Fake tensors and the fake process group (the planner).
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

# -- FSDPMemTracker (torch.distributed._tools: no public home). The planner subclasses it and
#    overrides `_update_peak_stats`, which upstream calls after every op with the peak state.
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType  # noqa: F401

UPDATE_PEAK_STATS = "_update_peak_stats"


def tracker_current(tracker: FSDPMemTracker) -> dict | None:
    """{device: {category: bytes}} right now, or None where this torch keeps it elsewhere."""
    return getattr(tracker, "_curr_mem_snap", None)


def tracker_peaks(tracker: FSDPMemTracker) -> tuple[dict, dict]:
    """(device -> peak bytes, device -> snapshot at that peak): the dicts the tracker reports from."""
    return tracker._peak_mem, tracker._peak_mem_snap


def tracker_module_state(tracker: FSDPMemTracker) -> tuple[Any, bool]:
    """(FQNs of the modules running now, whether in backward), from the tracker's ModTracker."""
    return tracker._mod_tracker.parents, tracker._mod_tracker.is_bw


def tracker_categories(values: tuple[str, ...]) -> tuple:
    """The tracker's category enum members whose names (`.value`) are in `values`."""
    return tuple(k for k in _FSDPRefType if k.value in values)


# -- torch.compile's backend registry.
def compile_backends() -> list[str]:
    import torch._dynamo

    return torch._dynamo.list_backends(exclude_tags=())


# -- DeviceMesh keeps its process groups in `_pg_registry` (torch >= 2.9; older meshes hold names only).
def release_mesh_groups(mesh: Any) -> None:
    registry = getattr(mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()


def float8_linear_class() -> type | None:
    """torchao's Float8Linear, or None where torchao is not installed."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return None
    return Float8Linear


__all__ = ["compute_local_shape_and_global_offset", "set_element", "FakeTensorMode", "FakeStore", "FSDPMemTracker",
           "tracker_current", "tracker_peaks", "tracker_module_state", "tracker_categories", "UPDATE_PEAK_STATS",
           "compile_backends", "release_mesh_groups", "float8_linear_class", "torch"]
