"""The global sample order: the O(1)-memory Feistel permutation and SampleOrder's dealing and state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest
import torch

from shardlm.data import order as order_module
from shardlm.data.order import ORDER_VERSION, Permutation, SampleOrder
from shardlm.errors import DataError

SIZES = [1, 2, 3, 4, 5, 7, 16, 17, 1000, 4097, 2**16 + 1]


@pytest.mark.parametrize("n", SIZES)
def test_permutation_is_a_bijection_and_scalar_equals_vectorised(n):
    for seed in (0, 1, 12345, -3):
        for epoch in (0, 5):
            perm = Permutation(n, seed, epoch)
            vec = perm.permute(np.arange(n))
            assert vec.dtype == np.int64 and sorted(vec.tolist()) == list(range(n)), (seed, epoch)
            some = np.unique(np.linspace(0, n - 1, 300).astype(np.int64))
            assert [perm(int(i)) for i in some] == vec[some].tolist()
    assert Permutation(n, 3, 1).permute(np.zeros((0,), dtype=np.int64)).shape == (0,)
    with pytest.raises(IndexError):
        Permutation(n, 0, 0)(n)
    with pytest.raises(IndexError):
        Permutation(n, 0, 0).permute(np.array([0, n]))


def test_permute_keeps_the_shape():
    perm = Permutation(1000, 2, 0)
    idx = np.arange(24).reshape(2, 3, 4)
    assert perm.permute(idx).shape == (2, 3, 4) and perm.permute(idx).ravel().tolist() == perm.permute(
        np.arange(24)).tolist()


# Pinned outputs: the order is part of the checkpoint contract. If these change, bump ORDER_VERSION.
PINNED = {(1000, 7, 3): [83, 140, 22, 544, 889, 422, 380, 921, 709, 279, 408, 27],
          (10**9, 0, 0): [956188718, 315789759, 147706878, 558323754, 869667640, 362436760],
          (5, 1, 0): [3, 4, 2, 0, 1]}

_CHILD = """
import json, numpy as np
from shardlm.data.order import Permutation
print(json.dumps({f"{n},{s},{e}": Permutation(n, s, e).permute(np.arange(k)).tolist()
                  for n, s, e, k in [(1000, 7, 3, 12), (10**9, 0, 0, 6), (5, 1, 0, 5), (77, 99, 1, 77)]}))
"""


def test_order_is_pinned_and_the_same_in_another_process_with_another_hash_seed():
    for (n, s, e), want in PINNED.items():
        assert Permutation(n, s, e).permute(np.arange(len(want))).tolist() == want
        assert [Permutation(n, s, e)(i) for i in range(len(want))] == want
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    child = json.loads(out.stdout)
    for (n, s, e), want in PINNED.items():
        assert child[f"{n},{s},{e}"] == want
    assert child["77,99,1"] == Permutation(77, 99, 1).permute(np.arange(77)).tolist()


def test_seeds_and_epochs_give_different_orders():
    n = 4097
    orders = {(s, e): tuple(Permutation(n, s, e).permute(np.arange(n)).tolist()) for s in range(4) for e in range(4)}
    assert len(set(orders.values())) == len(orders)
    a, b = np.array(orders[(0, 0)]), np.array(orders[(0, 1)])
    assert (a == b).mean() < 0.01  # unrelated, not a shifted copy


def _quality(perm: np.ndarray) -> dict[str, float]:
    """Crude statistics of a permutation of [0, n) that a random one passes with a wide margin."""
    n = len(perm)
    i = np.arange(n)
    first = np.histogram(perm[:256], bins=8, range=(0, n))[0]
    return {"displacement": float(np.abs(perm - i).mean() / n),  # random: ~1/3
            "corr": float(abs(np.corrcoef(i, perm)[0, 1])),  # random: ~0 (sd 1/sqrt(n))
            "neighbours": float((np.abs(np.diff(perm)) < n / 20).mean()),  # random: 2d - d^2 ~ 0.0975
            "first_chi2": float(((first - 32) ** 2 / 32).sum())}  # chi2 with 7 dof: < 24 at p = 0.001


def _looks_random(q: dict[str, float]) -> bool:
    return (abs(q["displacement"] - 1 / 3) < 0.03 and q["corr"] < 0.06 and abs(q["neighbours"] - 0.0975) < 0.02
            and q["first_chi2"] < 30)


def test_permutation_looks_random_and_the_check_catches_broken_round_functions(monkeypatch):
    for n in (4096, 5000, 2**16 + 1):
        for seed in (0, 1, 2):
            q = _quality(Permutation(n, seed, 0).permute(np.arange(n)))
            assert _looks_random(q), (n, seed, q)
    broken = {"identity": lambda z: z, "constant": lambda z: z & np.uint64(0),
              "low bits only": lambda z: z * np.uint64(3)}
    for name, fn in broken.items():
        monkeypatch.setattr(order_module, "_mix64_array", fn)
        q = _quality(Permutation(4096, 1, 0).permute(np.arange(4096)))
        assert not _looks_random(q), (name, q)
    monkeypatch.undo()
    monkeypatch.setattr(Permutation, "ROUNDS", 2)
    assert not _looks_random(_quality(Permutation(4096, 1, 0).permute(np.arange(4096))))


def test_a_billion_rows_take_no_memory_and_a_step_is_fast():
    tracemalloc.start()
    try:
        order = SampleOrder(10**9, micro_batch_size=64, grad_accum=16, dp_rank=0, dp_size=1, seed=3)
        order.rows_for_step()
        t0 = time.perf_counter()
        steps = [order.rows_for_step() for _ in range(5)]
        per_step = (time.perf_counter() - t0) / 5
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20, peak
    assert per_step < 0.05, per_step  # a 1024-sample global batch
    rows = [r for step in steps for mb in step for r in mb]
    assert len(rows) == 5 * 1024 and len(set(rows)) == len(rows) and 0 <= min(rows) and max(rows) < 10**9
    far = SampleOrder(10**9, 8, 4, 3, 8, seed=3)
    far.load_state_dict({"samples_seen": 10**9 * 7 + 10**9 - 100, "order_version": ORDER_VERSION})
    assert len(far.rows_for_step()) == 4  # straddles an epoch boundary


@pytest.mark.parametrize("shuffle", [True, False])
def test_rows_for_step_equals_the_scalar_row(shuffle):
    order = SampleOrder(37, micro_batch_size=3, grad_accum=2, dp_rank=1, dp_size=2, seed=9, shuffle=shuffle)
    ref = SampleOrder(37, 3, 2, 1, 2, seed=9, shuffle=shuffle)
    for step in range(20):  # 12 samples a step: crosses several epoch boundaries
        got = order.rows_for_step()
        base = step * 12
        want = [[ref.row(base + k * 6 + 3 + j) for j in range(3)] for k in range(2)]
        assert got == want
    if not shuffle:
        assert SampleOrder(5, 2, 1, 0, 1, shuffle=False).rows_for_step() == [[0, 1]]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    n = 50
    order = SampleOrder(n, micro_batch_size=5, grad_accum=1, dp_rank=0, dp_size=1, seed=4)
    seen = [r for _ in range(30) for mb in order.rows_for_step() for r in mb]  # 3 epochs
    epochs = [seen[e * n : (e + 1) * n] for e in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


def _global_batches(n, mbs, accum, dp, steps, seed=1, start=None):
    """Every rank's micro-batches, merged into each step's global batch in sample order."""
    ranks = [SampleOrder(n, mbs, accum, r, dp, seed=seed) for r in range(dp)]
    if start is not None:
        for o in ranks:
            o.load_state_dict(start)
    out = []
    for _ in range(steps):
        per_rank = [o.rows_for_step() for o in ranks]
        out.append([row for k in range(accum) for r in range(dp) for row in per_rank[r][k]])
    return out, ranks[0].state_dict()


def test_global_batch_is_the_same_on_any_dp_and_resume_on_another_dp_is_exact():
    n, g = 101, 16
    straight, _ = _global_batches(n, 16, 1, 1, 12)
    for mbs, accum, dp in ((8, 1, 2), (2, 2, 4), (1, 4, 4)):
        got, _ = _global_batches(n, mbs, accum, dp, 12)
        assert got == straight, (mbs, accum, dp)
    first, state = _global_batches(n, 4, 2, 2, 5)
    assert int(state["samples_seen"]) == 5 * g
    second, state = _global_batches(n, 1, 4, 4, 4, start=state)
    third, _ = _global_batches(n, 16, 1, 1, 3, start=state)
    assert first + second + third == straight


def test_state_is_tensors_with_a_version_and_old_orders_are_refused():
    order = SampleOrder(10, 2, 2, 1, 2, seed=1)
    order.rows_for_step()
    state = order.state_dict()
    assert set(state) == {"samples_seen", "order_version"}
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.int64 for v in state.values())
    assert SampleOrder.ORDER_VERSION == ORDER_VERSION == 2 and int(state["order_version"]) == 2
    again = SampleOrder(10, 2, 2, 1, 2, seed=1)
    again.load_state_dict(state)
    assert again.samples_seen == 8
    again.load_state_dict({"samples_seen": 0})  # nothing consumed: no order to disagree with
    with pytest.raises(DataError, match=r"^the checkpoint's sample order is from an older shardlm \(version 1\): "
                                        r"its resume would repeat or skip samples; start fresh "
                                        r"\(checkpoint.resume=none\) or use the shardlm that wrote it$"):
        again.load_state_dict({"samples_seen": torch.tensor(8)})
    with pytest.raises(DataError, match="older shardlm"):
        again.load_state_dict({"samples_seen": 8, "order_version": torch.tensor(1)})
    with pytest.raises(DataError, match="newer shardlm"):
        again.load_state_dict({"samples_seen": 8, "order_version": 3})
