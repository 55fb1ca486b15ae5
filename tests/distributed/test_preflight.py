"""Preflight (GEMM + all-reduce per mesh dimension, one verdict on every rank) and StepTimes (stragglers).

One spawn of 4 gloo ranks on a 2x2 mesh (dp_replicate x dp_shard, 2 "nodes" of 2) runs the preflight
three times:

* clean: every figure positive, the same result on every rank, nobody named;
* rank 2's GEMM delayed by 3x the clean median GEMM time (a sleep in the timed region): rank 2,
  and only rank 2, is named, with its node and local rank;
* every all-reduce rank 2 takes part in delayed by 3x the slowest clean one (a slow link): no rank is
  named by its GEMM, and the two groups that contain rank 2 (dp_replicate {0, 2}, dp_shard {2, 3})
  are the slow groups.

All three at slow_factor=2.0, not the default 1.2: four processes share two loaded cores here, and
even with the ranks taking turns (preflight does on CPU) a 1.4 ms GEMM's median of 9 wanders between
ranks: clean runs named a rank at 1.2x now and then (seen up to 1.44x). The delays (~4x) are far
above 2x, the noise below it.
"""

from __future__ import annotations

import pytest
from helpers.launch import run_ranks

from shardlm.distributed.preflight import StepTimes, step_time_slots

SLOW = 2.0  # not the default 1.2: four ranks on two loaded cores are noisier than that (see the docstring)


def _worker() -> dict:
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from shardlm.distributed.env import init_distributed
    from shardlm.distributed.preflight import preflight

    env = init_distributed("cpu")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    cpu = torch.device("cpu")
    t0 = time.perf_counter()
    clean = preflight(mesh, cpu, reps=9, local_world_size=2, slow_factor=SLOW)
    clean_s = time.perf_counter() - t0
    extra = 3 * statistics.median(clean.gemm_s)
    ar_extra = 3 * max(g.seconds for g in clean.groups)

    def slow_at(phase: str, seconds: float):
        return (lambda p: time.sleep(seconds) if p == phase else None) if env.rank == 2 else None

    slow_gemm = preflight(mesh, cpu, reps=9, local_world_size=2, slow_factor=SLOW,
                          delay=slow_at("gemm", extra))
    slow_ar = preflight(mesh, cpu, reps=9, local_world_size=2, slow_factor=SLOW,
                        delay=slow_at("all-reduce", ar_extra))
    # Every rank must hold the same result: gather each rank's and compare them with rank 0's.
    mine = [(r.gemm_s, r.groups, r.slow, r.slow_groups) for r in (clean, slow_gemm, slow_ar)]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"clean": clean, "slow_gemm": slow_gemm, "slow_ar": slow_ar, "clean_s": clean_s,
            "same_verdict": all(e == every[0] for e in every)}


@pytest.fixture(scope="module")
def runs() -> dict:
    out = run_ranks(4, _worker)
    for name in ("clean", "slow_gemm", "slow_ar"):
        print("\n".join(out[name].lines()))
    return out


def test_clean_run_figures(runs):
    clean = runs["clean"]
    assert runs["same_verdict"]
    assert clean.world_size == 4 and clean.gemm_n == 384 and len(clean.gemm_s) == 4
    assert all(t > 0 for t in clean.gemm_s)
    assert set(clean.allreduce) == {"dp_replicate", "dp_shard"}
    assert all(bw > 0 and s > 0 for s, bw in clean.allreduce.values())
    assert sorted(g.ranks for g in clean.groups) == [(0, 1), (0, 2), (1, 3), (2, 3)]
    assert clean.slow == [] and clean.slow_groups == [] and clean.ok, clean.lines()
    summary = clean.lines()[0]
    assert summary.startswith("preflight: 4 ranks, GEMM 384^3 float32 median ") and "GFLOP/s" in summary
    assert "all-reduce 4 MiB: dp_replicate " in summary and "busbw" in summary and len(clean.lines()) == 1
    assert runs["clean_s"] < 5, "the preflight must stay cheap"


def test_slow_gemm_names_the_rank(runs):
    res = runs["slow_gemm"]
    assert res.slow == [2], res.lines()
    assert not res.ok
    line = res.lines()[1]
    assert line.startswith("preflight: rank 2 (node 1, local rank 0) is slow: GEMM "), line
    assert "all-reduce over dp_replicate" in line and "all-reduce over dp_shard" in line
    assert res.message().startswith(line) and "parallel.preflight=strict" in res.message()


def test_slow_all_reduce_names_the_groups(runs):
    res = runs["slow_ar"]
    assert res.slow == [], res.lines()
    assert sorted((g.dim, g.ranks) for g in res.slow_groups) == [("dp_replicate", (0, 2)), ("dp_shard", (2, 3))]
    assert any(line.startswith("preflight: the all-reduce over dp_shard is slow in the group of ranks 2, 3: ")
               for line in res.lines()), res.lines()


# -- StepTimes: pure bookkeeping, no processes.

def test_max_rank_and_spread():
    st = StepTimes(4)
    assert st.record([1.0, 1.0, 2.0, 1.0]) == {"step_time_max_rank": 2, "step_time_spread": 1.0}
    rec = st.record([0.9, 1.0, 1.1, 1.2])
    assert rec["step_time_max_rank"] == 3 and rec["step_time_spread"] == pytest.approx(0.3 / 1.05)
    assert st.straggler_line() is None


def test_persistent_straggler_named_once():
    st = StepTimes(8, local_world_size=4, persist=3)
    slow = [1.0] * 5 + [1.5] + [1.0] * 2
    for _ in range(2):
        st.record(slow)
        assert st.straggler_line() is None
    st.record(slow)
    line = st.straggler_line()
    assert line == ("straggler: rank 5 (node 1, local rank 1) was the slowest in the last 3 logs, 1.50x the "
                    "median step time of the others (host clock: data loading, CPU contention, a slow disk or a "
                    "throttled GPU)")
    assert st.straggler_line() is None  # read once
    for _ in range(3):  # still slow: the same episode, not said again
        st.record(slow)
        assert st.straggler_line() is None
    st.record([1.0] * 8)  # recovered: the episode ends; a new one is named again
    for _ in range(3):
        st.record(slow)
    assert st.straggler_line() is not None


def test_slow_once_or_changing_rank_is_not_named():
    st = StepTimes(4, persist=3)
    even = [1.0, 1.0, 1.0, 1.0]
    for times in ([1.0, 1.0, 1.6, 1.0], even, [1.0, 1.0, 1.6, 1.0], even):  # slow once at a time
        st.record(times)
        assert st.straggler_line() is None
    for slowest in (1, 1, 3, 3, 1, 1):  # the slowest rank changes before 3 logs in a row: resets
        times = [1.0] * 4
        times[slowest] = 1.6
        st.record(times)
        assert st.straggler_line() is None
    for _ in range(3):  # slowest but within 1.2x of the others: no straggler
        st.record([1.0, 1.0, 1.15, 1.0])
    assert st.straggler_line() is None
    st = StepTimes(4, persist=1, min_excess_s=0.01)
    st.record([0.010, 0.010, 0.018, 0.010])  # 1.8x, but only 8 ms: below the floor
    assert st.straggler_line() is None
    st.record([0.010, 0.010, 0.021, 0.010])
    assert st.straggler_line().startswith("straggler: rank 2 ")


def test_two_ranks_and_slots():
    st = StepTimes(2, local_world_size=2, persist=1)
    st.record([1.0, 1.25])  # compared with the other rank, not the mean of both
    assert st.straggler_line().startswith("straggler: rank 1 (node 0, local rank 1) ")
    summed = [a + b for a, b in zip(step_time_slots(0.5, 0, 3), step_time_slots(0.7, 2, 3))]
    assert summed == [0.5, 0.0, 0.7]
    with pytest.raises(ValueError):
        st.record([1.0])
