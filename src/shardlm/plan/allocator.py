"""The CUDA caching allocator, replayed: what `torch.cuda.max_memory_reserved()` reads after a planned step.

Tensors get memory from segments PyTorch reserves from the device (c10/cuda/CUDACachingAllocator.cpp). shardlm's
environment presets set `expandable_segments:True` (so does torchtitan's launch script, whose published figures
are reserved memory). Then, per stream and pool, one segment grows by mapping fixed-size pages at its end:

* a request is rounded up to 512 B; up to 1 MiB it goes to the small pool (2 MiB pages), else the large pool
  (20 MiB pages, kLargeBuffer);
* it takes the smallest free block of its stream and pool that holds it (best fit; the lowest address among
  equals), split when at least 512 B are left (expandable segments split in both pools);
* when no free block holds it, the segment maps pages at its end, joined to the last block if that is free;
* a freed block merges with free neighbours; nothing is unmapped (a training loop calls no `empty_cache`).

So reserved >= allocated, by fragmentation: free blocks too small or in the wrong place for a request, each
stream's own segment, page rounding. `replay` runs a step's allocations and frees in their order, each on the
stream FSDP2 uses (all-gather buffers on the all-gather stream, reduce-scatter buffers on the reduce-scatter
stream, the rest on the compute stream), after the state that exists before the step, twice over (the second step
starts from the first one's free blocks; `max_memory_reserved` is the running maximum since the start).

What it leaves out: cross-stream frees that wait for an event (FSDP2 frees its buffers after the consuming stream
has waited, so a block comes back a little later than here), and the allocator's rare paths (OOM retry that frees
cached blocks, `max_split_size_mb`, garbage-collection thresholds). Unproven on a GPU: no device has been lent to
this project yet (benchmarks/gpu_memory.py is the prepared check: planned vs `torch.cuda.max_memory_reserved`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple of this
SMALL_SIZE = 1 << 20  # kSmallSize: requests up to this size use the small pool
SMALL_PAGE = 2 << 20  # kSmallBuffer: the small pool's mapping granularity
LARGE_PAGE = 20 << 20  # kLargeBuffer: the large pool's mapping granularity (expandable segments)


def round_size(n: int) -> int:
    """The allocator's `round_size`: at least 512 B, a multiple of 512 B."""
    return max(MIN_BLOCK, -(-n // MIN_BLOCK) * MIN_BLOCK)


@dataclass
class _Block:
    start: int
    size: int
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


@dataclass
class Segment:
    """One expandable segment (one stream, one pool): address-ordered blocks from 0 to `mapped`."""

    small: bool  # the pool: small (2 MiB pages) or large (20 MiB pages)
    mapped: int = 0
    last: _Block | None = None
    _free: list[tuple[int, int]] = field(default_factory=list)  # (size, start), sorted: best fit by bisect
    _at: dict[int, _Block] = field(default_factory=dict)  # start -> free block

    def _add_free(self, b: _Block) -> None:
        b.free = True
        bisect.insort(self._free, (b.size, b.start))
        self._at[b.start] = b

    def _take_free(self, b: _Block) -> None:
        i = bisect.bisect_left(self._free, (b.size, b.start))
        del self._free[i]
        del self._at[b.start]
        b.free = False

    def _split(self, b: _Block, size: int) -> _Block:
        """`b` (not free) keeps `size` bytes; the rest becomes a free block after it, when worth keeping."""
        rest = b.size - size
        if rest >= MIN_BLOCK:
            tail = _Block(b.start + size, rest, True, b, b.next)
            if b.next is not None:
                b.next.prev = tail
            else:
                self.last = tail
            b.next, b.size = tail, size
            self._add_free(tail)
        return b

    def alloc(self, size: int) -> _Block:
        i = bisect.bisect_left(self._free, (size, -1))
        if i < len(self._free):  # best fit among the mapped free blocks
            b = self._at[self._free[i][1]]
            self._take_free(b)
            return self._split(b, size)
        page = SMALL_PAGE if self.small else LARGE_PAGE
        tail = self.last if self.last is not None and self.last.free else None
        need = size - (tail.size if tail else 0)
        grow = -(-need // page) * page
        self.mapped += grow
        if tail is not None:  # map pages after the free last block and take both
            self._take_free(tail)
            tail.size += grow
            return self._split(tail, size)
        b = _Block(self.mapped - grow, grow, False, self.last)
        if self.last is not None:
            self.last.next = b
        self.last = b
        return self._split(b, size)

    def free(self, b: _Block) -> None:
        for n in (b.prev, b.next):  # merge with free neighbours
            if n is not None and n.free:
                self._take_free(n)
                lo, hi = (n, b) if n is b.prev else (b, n)
                lo.size += hi.size
                lo.next = hi.next
                if hi.next is not None:
                    hi.next.prev = lo
                if self.last is hi:
                    self.last = lo
                b = lo
        self._add_free(b)


class CachingAllocator:
    """Expandable-segment caching allocator over any number of streams; reserved bytes and their peak."""

    def __init__(self) -> None:
        self.segments: dict[tuple[str, bool], Segment] = {}
        self.allocated = self.peak_allocated = self.peak_reserved = 0
        self._live: dict[object, tuple[Segment, _Block, int]] = {}

    @property
    def reserved(self) -> int:
        return sum(s.mapped for s in self.segments.values())

    def mapped(self) -> dict[str, int]:
        """Bytes mapped per segment ("stream/small" or "stream/large"): never shrinking, so at the end of a replay
        they add up to the peak reserved."""
        return {f"{stream}/{'small' if small else 'large'}": s.mapped for (stream, small), s in self.segments.items()}

    def alloc(self, key: object, nbytes: int, stream: str = "compute") -> None:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        seg = self.segments.setdefault((stream, small), Segment(small))
        self._live[key] = (seg, seg.alloc(size), size)
        self.allocated += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, key: object) -> None:
        entry = self._live.pop(key, None)
        if entry is None:
            return
        seg, block, size = entry
        seg.free(block)
        self.allocated -= size


Event = tuple[int, object, int, str]  # (+1 alloc / -1 free, key, bytes, stream)


def replay(before: list[Event], step: list[Event], steps: int = 2) -> CachingAllocator:
    """The allocator after `before` (the state that exists when the step starts) and `steps` repeats of `step`,
    each repeat with keys of its own (what a step leaves allocated, e.g. its loss, stays so: a few bytes)."""
    a = CachingAllocator()
    for kind, key, nbytes, stream in before:
        if kind > 0:
            a.alloc(("before", key), nbytes, stream)
        else:
            a.free(("before", key))
    for rep in range(steps):
        for kind, key, nbytes, stream in step:
            if kind > 0:
                a.alloc((rep, key), nbytes, stream)
            else:
                a.free((rep, key))
    return a
