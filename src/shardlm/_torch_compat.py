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
UPDATE_SNAP = "_update_snap"  # (update type, winfo, old bytes, old category): every add, free, relabel, resize


def snap_update(u_type: Any) -> str:
    """The name of a tracker `_update_snap` update type: ADD, DEL, REF (relabel) or SIZE (storage resize)."""
    return u_type.name


def winfo_bytes(winfo: Any) -> int:
    """Bytes a tracked storage holds now (`_WeakRefInfo.mem_consumed`)."""
    return winfo.mem_consumed


def winfo_category(winfo: Any) -> str:
    """The tracker's category name of a tracked storage (`_WeakRefInfo.reftype.value`)."""
    return str(winfo.reftype.value)


def tracker_current(tracker: FSDPMemTracker) -> dict | None:
    """{device: {category: bytes}} right now, or None where this torch keeps it elsewhere."""
    return getattr(tracker, "_curr_mem_snap", None)


def tracker_peaks(tracker: FSDPMemTracker) -> tuple[dict, dict]:
    """(device -> peak bytes, device -> snapshot at that peak): the dicts the tracker reports from."""
    return tracker._peak_mem, tracker._peak_mem_snap


def tracker_module_state(tracker: FSDPMemTracker) -> tuple[Any, bool]:
    """(FQNs of the modules running now, whether in backward), from the tracker's ModTracker."""
    return tracker._mod_tracker.parents, tracker._mod_tracker.is_bw


def tracker_register(tracker: FSDPMemTracker, t: torch.Tensor, category: str) -> set:
    """Count `t` (one that exists already) under the tracker's category named `category` (e.g. "Sharded Param"),
    relabelling it if the tracker knows it under another (`_update_and_maybe_create_winfos`, as upstream labels the
    tensors it finds itself). Returns the records of its storages."""
    kind = next(k for k in _FSDPRefType if k.value == category)
    return tracker._update_and_maybe_create_winfos(t, kind)


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


# -- Process-group timeouts. No public setter changes an existing group's timeout:
#    `distributed_c10d._set_pg_timeout(timeout, group)` (in c10d since 2.3; checked on 2.13; torchtitan's
#    `set_pg_timeouts` uses it) calls `_set_default_timeout` on the group's gloo and NCCL backends. Measured on 2.13 (gloo): a
#    collective with a stalled peer raises after the new timeout. pytorch#165422 reports gloo ops keeping
#    their old timeout on some builds (fix proposed in pytorch#167052); not measured on 2.11. Where it does
#    not take, the watchdog's backstop still ends the process (distributed/watchdog.py).
def set_pg_timeout(group: Any, seconds: float) -> None:
    """Every later collective on `group` (gloo and NCCL backends) times out after `seconds`."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=seconds)
    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(timeout, group)
        return
    for device in group._device_types:  # older spelling of the same thing
        group._get_backend(device)._set_default_timeout(timeout)


# -- Flight recorder. ProcessGroupNCCL keeps its own recorder, read by `_dump_nccl_trace` (CUDA builds only;
#    in the binding lists of recent releases, not run here: no GPU); the generic one (gloo and others,
#    entries only with TORCH_FR_BUFFER_SIZE > 0) by `_dump_fr_trace` (2.13, checked: gloo collectives show
#    up; not checked on 2.11). Both return the pickle torch itself writes on a timeout, so the
#    `fr_trace` / `torchfrtrace` analyzer reads either. Never raises: a diagnostic must not stop an exit.
def dump_flight_recorder(backend: str) -> bytes | None:
    """This process's flight-recorder dump (pickle), or None where there is none."""
    c10d = getattr(torch._C, "_distributed_c10d", None)
    names = ("_dump_nccl_trace", "_dump_fr_trace") if backend == "nccl" else ("_dump_fr_trace",)
    for name in names:
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            blob = fn()
        except Exception:
            continue
        if blob:
            return bytes(blob)
    return None


# -- CUDA memory snapshots for pytorch.org/memory_viz (observe/profiler.py). Private but documented in the
#    "Understanding CUDA Memory Usage" guide: `torch.cuda.memory._record_memory_history(enabled="all" | None,
#    max_entries=N)` (this spelling since 2.1) and `_dump_snapshot(filename)`. Checked on 2.13: the names and
#    keywords only (CPU build: recording needs CUDA); not run on a GPU nor on 2.11 yet. Guarded: a torch without
#    them gives no snapshot, and the profiler says so.
def record_memory_history(max_entries: int) -> bool:
    """Start recording CUDA allocations (with stacks) for a snapshot; False where this torch cannot."""
    fn = getattr(torch.cuda.memory, "_record_memory_history", None)
    if fn is None or not torch.cuda.is_available():
        return False
    fn(enabled="all", max_entries=max_entries)
    return True


def dump_memory_snapshot(path: str) -> None:
    """Write the recorded allocation history (a pickle pytorch.org/memory_viz reads) to `path`."""
    torch.cuda.memory._dump_snapshot(path)


def stop_memory_history() -> None:
    """Stop recording allocations (no cost from here on)."""
    torch.cuda.memory._record_memory_history(enabled=None)


__all__ = ["compute_local_shape_and_global_offset", "set_element", "FakeTensorMode", "FakeStore", "FSDPMemTracker",
           "tracker_current", "tracker_peaks", "UPDATE_SNAP", "snap_update", "winfo_bytes", "winfo_category", "tracker_module_state", "tracker_categories", "tracker_register", "UPDATE_PEAK_STATS",
           "compile_backends", "release_mesh_groups", "float8_linear_class", "set_pg_timeout",
           "dump_flight_recorder", "record_memory_history", "dump_memory_snapshot", "stop_memory_history", "torch"]


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """The local shard object a DTensor wraps (`_local_tensor`), not a view of it: `to_local()` of a DTensor
    Parameter returns a view, which loses a tensor subclass's identity (an NF4Tensor's quantisation pieces are
    attributes of the object FSDP2 all-gathers). Checked on 2.13; 2.11 has the same attribute."""
    return t._local_tensor


def dynamo_no_cache_limit():
    """torch._dynamo.utils.disable_cache_limit (a context manager: one compiled graph per shape with no
    recompile limit, as torchao's AdamW8bit uses it), or None where this torch lacks it (2.11 - 2.13 have it)."""
    from torch._dynamo import utils as dynamo_utils

    return getattr(dynamo_utils, "disable_cache_limit", None)


def has_grouped_mm() -> bool:
    """Whether a grouped bf16 matmul kernel exists for this torch and GPU: `torch.nn.functional.grouped_mm`
    (public in 2.13; 2.11 has `torch._grouped_mm`), on compute capability >= 9.0 (the kernel torchtitan's MoE
    uses on Hopper; earlier GPUs take the per-expert loop). Unproven on a GPU here: see docs/moe.md."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return False
    return hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a (n, k) rows grouped by `offsets` (int32 ends of each group) times b (G, k, m) -> (n, m)."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    if fn is not None:
        return fn(a, b, offs=offsets)
    return torch._grouped_mm(a, b, offs=offsets)


def is_fake(t: torch.Tensor) -> bool:
    """Whether `t` is a FakeTensor (the planner's fake step): data-dependent reads must not happen on it."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return _is_fake(t)
