"""FSDPMemTracker, lighter, with per-phase peaks, the CPU-offload peak and the allocation order."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardlm._torch_compat import (UPDATE_PEAK_STATS, UPDATE_SNAP, FSDPMemTracker, snap_update, tracker_categories,
                                   tracker_current, tracker_module_state, tracker_peaks, tracker_register,
                                   winfo_bytes, winfo_category)
from shardlm.plan.allocator import Event
from shardlm.plan.report import OFFLOADED

# Where FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) allocates what the tracker labels:
# the all-gather output on the all-gather copy-in stream; the reduce-scatter output, which becomes the sharded
# gradient, on the reduce-scatter stream (its input on the compute stream). Everything else: the compute stream.
STREAMS = {"All Gather": "all-gather", "Sharded Grad": "reduce-scatter"}


class PlanTracker(FSDPMemTracker):
    """FSDPMemTracker, lighter and with one more number.

    `_update_peak_stats` runs after every op; upstream it also refreshes the per-module peaks of
    every active module (O(modules) per op), which the planner does not read. Here: the global
    peak snapshot (as upstream) and the peak of what stays on the GPU under CPU offload. The
    tracker's private state is read through shardlm._torch_compat.
    """

    offload_peak = 0
    events: list | None = None  # when a list: (+1 / -1, storage info, bytes) of every allocation and free, in order
    plain_grads: set  # storage records of the gradients of parameters FSDP does not manage (compute stream)
    phase = "step"  # set by `training_step`: "mb0", "mb1", "clip", "optim"
    phases: dict | None = None  # when a dict: per-phase peaks, for `extrapolate_peak` (see there)
    _offloaded_keys = tracker_categories(OFFLOADED)

    def _update_peak_stats(self, peak_state):  # overrides compat.UPDATE_PEAK_STATS
        curr = tracker_current(self)
        if curr is None:  # a torch whose internals differ: fall back to the upstream bookkeeping
            return super()._update_peak_stats(peak_state)
        peak_mem, peak_snap = tracker_peaks(self)
        total_all = off_all = 0
        for dev, dev_snap in curr.items():
            total = dev_snap["Total"]
            if peak_mem.get(dev, 0) < total:
                peak_mem[dev] = total
                peak_snap[dev] = dict(dev_snap)
            off = total - sum(dev_snap.get(k, 0) for k in self._offloaded_keys)
            if off > self.offload_peak:
                self.offload_peak = off
            total_all += total
            off_all += off
        if self.phases is not None:  # per-phase peaks: [total, snapshot at it, offload peak]
            key = phase_key(self.phase, *tracker_module_state(self))
            rec = self.phases.get(key)
            if rec is None:
                self.phases[key] = [total_all, {d: dict(v) for d, v in curr.items()}, off_all]
            else:
                if total_all > rec[0]:
                    rec[0], rec[1] = total_all, {d: dict(v) for d, v in curr.items()}
                if off_all > rec[2]:
                    rec[2] = off_all

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):  # overrides compat.UPDATE_SNAP
        if self.events is not None:
            kind = snap_update(u_type)
            if kind == "ADD":
                self.events.append((1, winfo, winfo_bytes(winfo)))
            elif kind == "DEL":
                self.events.append((-1, winfo, winfo_bytes(winfo)))
            elif kind == "SIZE":  # FSDP frees and refills unsharded storages by resizing them
                if old_mem_consumed:
                    self.events.append((-1, winfo, old_mem_consumed))
                if winfo_bytes(winfo):
                    self.events.append((1, winfo, winfo_bytes(winfo)))
        return super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

    def allocations(self, start: int = 0, stop: int | None = None, skip: tuple[str, ...] = ()) -> list[Event]:
        """`events[start:stop]` for `plan.allocator.replay`: each storage keyed by its record, on the stream its
        final category says (`STREAMS`); storages whose category is in `skip` left out (CPU offload: what lives
        in host memory)."""
        out, plain = [], getattr(self, "plain_grads", ())
        for kind, winfo, nbytes in self.events[start:stop]:
            category = winfo_category(winfo)
            if category not in skip:
                stream = "compute" if id(winfo) in plain else STREAMS.get(category, "compute")
                out.append((kind, id(winfo), nbytes, stream))
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # `tensor.device` on a fake tensor is itself an op (prim.device) and the autograd engine
        # asks it hundreds of times per block: it allocates nothing, skip the bookkeeping.
        if func is _PRIM_DEVICE:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def track_unmanaged(tracker: FSDPMemTracker, model: nn.Module) -> list:
    """Count the parameters FSDP does not manage (on one rank, `parallel.fsdp.single_copy_params`: plain tensors,
    not DTensors) as "Sharded Param", the one copy there is, and their gradients as "Sharded Grad" as they come;
    FSDPMemTracker sees only FSDP's own. Returns the hook handles (remove them when done)."""
    handles = []
    tracker.plain_grads = plain = set()

    def grad_hook(q: torch.Tensor) -> None:
        plain.update(id(w) for w in tracker_register(tracker, q.grad, "Sharded Grad"))

    for p in model.parameters():
        if isinstance(p, DTensor):
            continue
        tracker_register(tracker, p, "Sharded Param")
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(grad_hook))
    return handles


assert hasattr(FSDPMemTracker, UPDATE_PEAK_STATS) and hasattr(FSDPMemTracker, UPDATE_SNAP), \
    "FSDPMemTracker changed: review shardlm/_torch_compat.py"
_PRIM_DEVICE = torch.ops.prim.device.default


def phase_key(phase: str, parents, is_bw: bool) -> tuple:
    """(phase, forward/backward, (the block running,) or (), the root's other modules running)."""
    blocks, other = [], []
    for fqn in parents:
        parts = fqn.split(".")
        if len(parts) >= 3 and parts[1] == "layers" and parts[2].isdigit():
            blocks.append(int(parts[2]))
        elif len(parts) == 2:
            other.append(parts[1])
    # The block running is the last one entered: the highest index in forward, the lowest in
    # backward. Blocks whose backward has ended can linger in `parents` (with frozen LoRA bases the
    # tracker drops none until the end of backward): not part of the key.
    if blocks:
        blocks = [min(blocks) if is_bw else max(blocks)]
    return phase, bool(is_bw), tuple(blocks), tuple(sorted(other))
