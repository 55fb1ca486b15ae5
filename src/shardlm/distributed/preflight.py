"""Find the slow rank before it slows every step: a preflight check before step 1, step times during training.

Synchronous data parallelism runs at the speed of its slowest rank, and nothing in the loss says which
one that is. Two tools:

* `preflight(mesh, device)`: before step 1 every rank times a square GEMM and an all-reduce on each
  mesh dimension; every rank gets every rank's figures (one small all-gather over the default group's
  gloo backend), so all of them reach the same verdict. What is compared with what:

  - GEMM: a per-rank figure. A rank whose GEMM time is more than `slow_factor` x the median of the
    *other* ranks is named (with 2 ranks: more than 1.2x the other one; with many, the usual median).
  - all-reduce: a collective takes as long on every participant (the early ones wait for the late
    one), so a per-rank all-reduce time measures waiting and names no rank. What it can name is a
    *group*: every group along one mesh dimension (e.g. each node's dp_shard group) runs the same
    collective on the same kind of link, so a group more than `slow_factor` x the median time of the
    other groups of that dimension has a slow link or NIC (a rank in slow groups of both dimensions
    of an HSDP mesh is the likely culprit). A group's time is its last-arriving member's (the one that
    did not wait). Different dimensions are *not* compared with each other: the dp_replicate groups
    cross nodes and the dp_shard groups usually do not, so their bandwidths differ by design; the
    summary line prints both (bus bandwidth, nccl-tests' factor 2(n-1)/n).

  The caller decides what a finding means (parallel.preflight: warn with `lines()`, or stop with
  `message()` under "strict").

* `StepTimes`: during training, each log interval, every rank's *busy* host time per step goes into
  metrics.jsonl as `step_time_max_rank` / `step_time_spread`, and a rank that stays the slowest by
  more than `slow_factor` for `persist` logs in a row is named once. No collectives in here: the
  trainer gathers the times on the all-reduce it already makes (see `step_time_slots`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

GEMM_N = {"cuda": 8192, "cpu": 384}  # bf16 on GPUs (~1 ms on an H100); fp32 on CPU (a few ms on one core)
ALLREDUCE_BYTES = {"cuda": 64 * 2**20, "cpu": 4 * 2**20}


def where(rank: int, local_world_size: int) -> str:
    """`rank 5 (node 1, local rank 1)`."""
    lws = max(local_world_size, 1)
    return f"rank {rank} (node {rank // lws}, local rank {rank % lws})"


def slow_indices(values: Sequence[float], slow_factor: float) -> list[tuple[int, float, float]]:
    """(index, value, median of the others) for each value > slow_factor x the median of the other values."""
    out = []
    for i, v in enumerate(values):
        others = [w for j, w in enumerate(values) if j != i]
        if others and v > slow_factor * statistics.median(others):
            out.append((i, v, statistics.median(others)))
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _rate(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e12:.3g} TFLOP/s" if flops_per_s >= 1e12 else f"{flops_per_s / 1e9:.3g} GFLOP/s"


def _gbps(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.3g} GB/s"


@dataclass
class GroupTiming:
    """One process group of one mesh dimension: its all-reduce time and bus bandwidth.

    The time is the median over repetitions of the member that waited least (the last to arrive).
    """

    dim: str
    ranks: tuple[int, ...]
    seconds: float
    busbw: float  # bytes/s: size / time x 2(n-1)/n (nccl-tests); comparable across group sizes


@dataclass
class PreflightResult:
    world_size: int
    local_world_size: int
    gemm_n: int
    gemm_dtype: str
    gemm_s: list[float]  # per rank: median seconds of one n^3 matmul
    allreduce_bytes: int
    groups: list[GroupTiming]  # every group of every mesh dimension of size > 1
    slow_factor: float
    slow: list[int] = field(init=False)  # ranks whose GEMM is slow (computed)
    slow_groups: list[GroupTiming] = field(init=False)  # groups whose all-reduce is slow (computed)

    def __post_init__(self) -> None:
        self.slow = [r for r, _, _ in slow_indices(self.gemm_s, self.slow_factor)]
        self.slow_groups = []
        for dim in self.dims:
            gs = self.dim_groups(dim)
            self.slow_groups += [gs[i] for i, _, _ in slow_indices([g.seconds for g in gs], self.slow_factor)]

    @property
    def ok(self) -> bool:
        """No slow rank and no slow group."""
        return not self.slow and not self.slow_groups

    @property
    def dims(self) -> list[str]:
        return list(dict.fromkeys(g.dim for g in self.groups))

    def dim_groups(self, dim: str) -> list[GroupTiming]:
        return [g for g in self.groups if g.dim == dim]

    @property
    def allreduce(self) -> dict[str, tuple[float, float]]:
        """Per mesh dimension: (seconds, busbw bytes/s) of its median group (the one group, mostly)."""
        out = {}
        for dim in self.dims:
            gs = sorted(self.dim_groups(dim), key=lambda g: g.seconds)
            mid = gs[(len(gs) - 1) // 2]
            out[dim] = (mid.seconds, mid.busbw)
        return out

    @property
    def gemm_flops(self) -> float:
        return 2.0 * self.gemm_n**3

    def lines(self) -> list[str]:
        """The summary line, then one line per slow rank and per slow group."""
        return [self.summary(), *self.rank_lines(), *self.group_lines()]

    def summary(self) -> str:
        med = statistics.median(self.gemm_s)
        worst = max(range(self.world_size), key=lambda r: self.gemm_s[r])
        slowest = f", slowest rank {worst} {self.gemm_s[worst] / med:.2f}x" if self.world_size > 1 else ""
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        line = (f"preflight: {ranks}, GEMM {self.gemm_n}^3 {self.gemm_dtype} median {_ms(med)} "
                f"({_rate(self.gemm_flops / med)}{slowest})")
        if not self.groups:
            return line + "; no all-reduce (every mesh dimension has size 1)"
        dims = ", ".join(f"{d} {_gbps(bw)} busbw ({_ms(s)})" for d, (s, bw) in self.allreduce.items())
        return line + f"; all-reduce {self.allreduce_bytes / 2**20:g} MiB: {dims}"

    def rank_lines(self) -> list[str]:
        out = []
        for r, t, med in slow_indices(self.gemm_s, self.slow_factor):
            context = ""
            for g in (g for g in self.groups if r in g.ranks):
                others = [h.seconds for h in self.dim_groups(g.dim) if h is not g]
                vs = f" vs {_ms(statistics.median(others))}" if others else ""
                context += f"; all-reduce over {g.dim} {_ms(g.seconds)}{vs}"
            out.append(f"preflight: {where(r, self.local_world_size)} is slow: GEMM {_ms(t)} vs median "
                       f"{_ms(med)} ({t / med:.2f}x){context}")
        return out

    def group_lines(self) -> list[str]:
        out = []
        for dim in self.dims:
            gs = self.dim_groups(dim)
            for i, t, med in slow_indices([g.seconds for g in gs], self.slow_factor):
                g = gs[i]
                out.append(f"preflight: the all-reduce over {dim} is slow in the group of ranks "
                           f"{', '.join(map(str, g.ranks))}: {_ms(t)} ({_gbps(g.busbw)} busbw) vs median "
                           f"{_ms(med)} of the other {dim} groups ({t / med:.2f}x): a slow link or NIC on one "
                           "of its nodes")
        return out

    def message(self) -> str:
        """The error text for parallel.preflight=strict (meant for `not ok`)."""
        found = [*self.rank_lines(), *self.group_lines()]
        return ("\n".join(found) + f"\n(slow = more than {self.slow_factor:g}x the median of the others; "
                "parallel.preflight=strict stops here: replace or drain that node, or set "
                "parallel.preflight=true to warn and train anyway)")


def _host_barrier() -> None:
    """A barrier on the default group's CPU (gloo) backend: no device work, no NCCL barrier quirks."""
    dist.all_reduce(torch.zeros(1))


def _timed(fn: Callable[[], None], device: torch.device, reps: int, hook: Callable[[], None],
           turn: tuple[int, int] = (0, 1)) -> float:
    """Median host seconds of fn() (device-synchronised) over `reps`, after one warm-up.

    Each repetition starts after a host barrier. turn=(i, k): the ranks take k turns per repetition, one
    barrier each, and this one runs and times fn() in turn i (the others wait, untimed).
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    mine, turns = turn
    times = []
    for _ in range(reps):
        for t in range(turns):
            _host_barrier()
            if t == mine:
                t0 = time.perf_counter()
                hook()
                fn()
                sync()
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _mesh_groups(mesh: DeviceMesh, d: int) -> list[tuple[int, ...]]:
    """The global ranks of every group along mesh dimension d."""
    ranks = mesh.mesh.movedim(d, -1).reshape(-1, mesh.mesh.size(d))
    return [tuple(int(r) for r in row) for row in ranks]


def preflight(mesh: DeviceMesh, device: torch.device, *, slow_factor: float = 1.2, gemm_n: int | None = None,
              reps: int = 5, local_world_size: int = 1, allreduce_bytes: int | None = None,
              delay: Callable[[str], None] | None = None) -> PreflightResult:
    """Time a GEMM on every rank and an all-reduce on every mesh dimension; every rank returns the same result.

    Collective: call on every rank, before step 1. Each timed repetition starts after a host barrier (on
    the default group's gloo backend); on CPU the ranks take turns (see the comment below).
    `delay(phase)` ("gemm" / "all-reduce") runs inside each timed repetition, before the operation: a test
    hook to make a rank slow (its GEMM, or every all-reduce it takes part in, as a slow link would).
    """
    kind = "cuda" if device.type == "cuda" else "cpu"
    n = gemm_n or GEMM_N[kind]
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    hook = (lambda phase: (lambda: delay(phase))) if delay else (lambda phase: (lambda: None))
    rank, world = dist.get_rank(), dist.get_world_size()
    # GPUs are timed all at once (that is how they train). The ranks of a CPU host share its cores: timed
    # at once, they would measure how the OS scheduled them, so there they take turns (one rank, or one
    # group per mesh dimension, at a time).
    serial = kind == "cpu"

    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    gemm = _timed(lambda: torch.matmul(a, b, out=out), device, reps, hook("gemm"),
                  (rank, world) if serial else (0, 1))
    del a, b, out

    size = allreduce_bytes or ALLREDUCE_BYTES[kind]
    buf = torch.zeros(size // 4, device=device, dtype=torch.float32)
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    dims = [(d, name) for d, name in enumerate(names) if mesh.size(d) > 1]
    mine = [gemm]
    for d, name in dims:
        group = mesh.get_group(d)
        groups = _mesh_groups(mesh, d)
        turn = (next(i for i, g in enumerate(groups) if rank in g), len(groups)) if serial else (0, 1)
        mine.append(_timed(lambda: dist.all_reduce(buf, group=group), device, reps, hook("all-reduce"), turn))
    del buf

    # One all-gather of a small CPU tensor over the default group (gloo, also on GPUs: cpu:gloo,cuda:nccl).
    row = torch.tensor(mine, dtype=torch.float64)
    every = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(every, row)
    table = torch.stack(every).tolist()

    groups = []
    for col, (d, name) in enumerate(dims, start=1):
        for ranks in _mesh_groups(mesh, d):
            # Members that left the barrier early wait in the collective for the last one, whose time is
            # the collective's own: a late member is not a slow link.
            t = min(table[r][col] for r in ranks)
            k = len(ranks)
            groups.append(GroupTiming(name, ranks, t, size / t * 2 * (k - 1) / k))
    return PreflightResult(len(table), local_world_size, n, str(dtype).removeprefix("torch."),
                           [r[0] for r in table], size, groups, slow_factor)


def step_time_slots(busy_s: float, rank: int, world_size: int) -> list[float]:
    """A world-sized vector, zero but for this rank's slot: summed over the ranks (the trainer's host-side
    all-reduce) it is every rank's busy time, in rank order, ready for `StepTimes.record`."""
    slots = [0.0] * world_size
    slots[rank] = busy_s
    return slots


class StepTimes:
    """Per-rank step times, one record per log interval: the slowest rank, the spread, persistent stragglers.

    "Step time" here is a rank's *busy* host time per step: the step's wall time minus the time the rank
    waited in the step-start all-reduce (the token count). In synchronous training every rank's wall time
    is the same (each waits for the slowest at the first collective); the waiting is what tells the ranks
    apart: the slow rank waits least. The host clock covers device work too, since every step ends in a
    host read (the gradient norm). Pass each rank's mean busy time over the interval. Pure bookkeeping:
    the same on every rank, or kept on rank 0 only.
    """

    def __init__(self, world_size: int, local_world_size: int = 1, slow_factor: float = 1.2, persist: int = 3,
                 min_excess_s: float = 0.0):
        self.world_size, self.local_world_size = world_size, local_world_size
        self.slow_factor, self.persist = slow_factor, persist
        self.min_excess_s = min_excess_s  # and at least this much above the others' median (tiny CPU steps)
        self.rank: int | None = None  # the rank slow in the current run of records
        self.ratios: list[float] = []  # its time / the median of the others, per record of the run
        self.said = False  # this run was named already
        self.pending: str | None = None

    def record(self, per_rank_seconds: Sequence[float]) -> dict:
        """{"step_time_max_rank": the slowest rank, "step_time_spread": (max - min) / median}.

        The spread is a ratio of the median: 0.0 = every rank equally busy, 0.5 = the slowest rank is
        busy half a median step longer than the fastest one.
        """
        times = list(per_rank_seconds)
        if len(times) != self.world_size:
            raise ValueError(f"{len(times)} step times for {self.world_size} ranks")
        worst = max(range(len(times)), key=times.__getitem__)
        med = statistics.median(times)
        spread = (max(times) - min(times)) / med if med > 0 else 0.0
        slow = {i: t / m for i, t, m in slow_indices(times, self.slow_factor) if m > 0 and t - m >= self.min_excess_s}
        if worst in slow and worst == self.rank:
            self.ratios.append(slow[worst])
        elif worst in slow:
            self.rank, self.ratios, self.said = worst, [slow[worst]], False
        else:
            self.rank, self.ratios, self.said = None, [], False
        if self.rank is not None and len(self.ratios) >= self.persist and not self.said:
            self.said = True
            self.pending = (f"straggler: {where(self.rank, self.local_world_size)} was the slowest in the last "
                            f"{len(self.ratios)} logs, {statistics.mean(self.ratios):.2f}x the median step time "
                            "of the others (host clock: data loading, CPU contention, a slow disk or a throttled GPU)")
        return {"step_time_max_rank": worst, "step_time_spread": spread}

    def straggler_line(self) -> str | None:
        """The line naming a persistent straggler, once per episode (None otherwise); read after `record`."""
        line, self.pending = self.pending, None
        return line


class BusyTime:
    """A rank's busy host time per step: from leaving one step's token-count all-reduce to arriving at the
    next one (data loading, forward, backward, optimizer: all but the wait for the slowest rank), averaged
    over the steps since the last `slots` (see distributed/preflight.StepTimes)."""

    def __init__(self) -> None:
        self.left: float | None = None
        self.total, self.n = 0.0, 0

    def arrive(self) -> None:
        if self.left is not None:
            self.total += time.perf_counter() - self.left
            self.n += 1

    def leave(self) -> None:
        self.left = time.perf_counter()

    def slots(self, rank: int, world_size: int) -> list[float]:
        """This rank's mean busy time in its slot of a world-sized vector (then start a new interval)."""
        mean = self.total / self.n if self.n else 0.0
        self.total, self.n = 0.0, 0
        return step_time_slots(mean, rank, world_size)
