"""MixtureOrder: sample-level interleaving of weighted sources, dealt like SampleOrder; caps, resume, weight change."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shardlm.data.mixture import MixtureOrder
from shardlm.data.order import Permutation, derive_seed
from shardlm.errors import ConfigError, DataError


def _ranks(n_rows, weights, mbs, accum, dp, state=None, **kw):
    orders = [MixtureOrder(n_rows, weights, mbs, accum, r, dp, **kw) for r in range(dp)]
    for o in orders:
        if state is not None:
            o.load_state_dict(state)
    return orders


def _steps(orders, steps):
    """Each step's global batch of (source, row), rebuilt from every rank's slices in rank order per micro-batch."""
    out = []
    for _ in range(steps):
        per_rank = [o.rows_for_step() for o in orders]
        out.append([x for k in range(orders[0].accum) for r in range(len(orders)) for x in per_rank[r][k]])
    assert len({tuple(o.consumed) for o in orders}) == 1  # every rank agrees
    return out


def _greedy(consumed, weights, caps, count):
    """The scheme in plain Python: each sample to the non-exhausted source minimising (c_i + 0.5) / w_i."""
    c, out = list(consumed), []
    for _ in range(count):
        live = [i for i in range(len(c)) if caps[i] is None or c[i] < caps[i]]
        i = min(live, key=lambda i: ((c[i] + 0.5) / weights[i], i))
        out.append((i, c[i]))
        c[i] += 1
    return out


def test_three_to_one_is_realised_tightly_and_matches_the_plain_greedy():
    mix = MixtureOrder([1000, 300], [3.0, 1.0], micro_batch_size=4, grad_accum=2, dp_rank=0, dp_size=2, seed=5)
    assert mix.global_batch == 16 and mix.weights == [0.75, 0.25] and mix.shares() == [0.0, 0.0]
    ref = _greedy([0, 0], mix.weights, [None, None], 200 * 16)
    for step in range(200):
        src, k = mix.assign(16)
        assert list(zip(src.tolist(), k.tolist())) == ref[step * 16 : (step + 1) * 16]
        mix.rows_for_step()
        assert abs(mix.consumed[0] - 0.75 * mix.samples_seen) <= 1  # smooth: within a sample at every step
    assert abs(mix.shares()[0] - 0.75) < 0.02 and mix.samples_seen == 3200 and sum(mix.consumed) == 3200
    line = mix.describe()
    assert "\n" not in line and "source0 weight 0.750 share 0.750" in line and "exhausted" not in line


def test_three_sources_with_uneven_weights_and_the_plain_greedy_agree():
    w = [0.5, 0.3, 0.2]
    mix = MixtureOrder([7, 11, 13], [5, 3, 2], 3, 1, 0, 1, seed=1, epochs=[None, 2.0, None])
    got = [mix.assign(300)]
    assert list(zip(*(a.tolist() for a in got[0]))) == _greedy([0, 0, 0], w, [None, 22, None], 300)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_resume_on_another_dp_degree_continues_exactly(dp):
    kw = dict(seed=3, epochs=[None, 3.0], names=["web", "code"])
    n, w = [50, 20], [3, 1]
    straight = _steps(_ranks(n, w, 2, 2, 4, **kw), 20)  # global batch 16
    first = _ranks(n, w, 8, 2, 1, **kw)
    head = _steps(first, 10)
    state = first[0].state_dict()
    assert set(state) == {"samples_seen", "consumed", "base", "weights", "caps", "order_version"}
    assert int(state["samples_seen"]) == 160 and state["consumed"].tolist() == first[0].consumed
    assert head + _steps(_ranks(n, w, 16 // (2 * dp), 2, dp, state=state, **kw), 10) == straight
    # resume twice in a row, on yet other degrees
    mid = _ranks(n, w, 16 // dp, 1, dp, state=state, **kw)
    part = _steps(mid, 4)
    last = _ranks(n, w, 4, 1, 4, state=mid[-1].state_dict(), **kw)
    assert head + part + _steps(last, 6) == straight


def _per_source(batches, n_sources):
    rows = [[] for _ in range(n_sources)]
    for batch in batches:
        for s, r in batch:
            rows[s].append(r)
    return rows


def test_every_epoch_of_every_source_is_a_permutation_of_its_rows():
    n = [40, 24]
    batches = _steps(_ranks(n, [2, 1], 2, 3, 2, seed=8), 60)  # 720 samples: 12 epochs of 40, 10 of 24
    for i, rows in enumerate(_per_source(batches, 2)):
        epochs = [rows[e * n[i] : (e + 1) * n[i]] for e in range(len(rows) // n[i])]
        assert len(epochs) >= 9 and all(sorted(e) == list(range(n[i])) for e in epochs), i
        assert epochs[0] != epochs[1]
        k = np.arange(len(rows))
        seed = derive_seed(8, i)
        assert rows == [Permutation(n[i], seed, e)(p) for e, p in zip((k // n[i]).tolist(), (k % n[i]).tolist())]
    plain = _per_source(_steps(_ranks(n, [2, 1], 2, 3, 2, seed=8, shuffle=False), 5), 2)
    assert plain[1] == [k % 24 for k in range(len(plain[1]))]


def test_seed_changes_the_rows_not_the_interleaving_and_sources_get_their_own_order():
    a = _steps(_ranks([30, 30], [1, 1], 4, 1, 1, seed=0), 15)
    b = _steps(_ranks([30, 30], [1, 1], 4, 1, 1, seed=1), 15)
    assert [[s for s, _ in x] for x in a] == [[s for s, _ in x] for x in b] and a != b
    ra = _per_source(a, 2)
    assert ra[0] != ra[1]


def test_an_epochs_cap_stops_a_source_and_the_others_take_over():
    mix = MixtureOrder([40, 100], [1, 1], 4, 1, 0, 1, seed=2, epochs=[1, None], names=["small", "big"])
    batches = _steps([mix], 30)  # 120 samples; small gives 40 then stops
    small = _per_source(batches, 2)[0]
    assert sorted(small) == list(range(40)) and mix.consumed == [40, 80]
    assert mix.exhausted() == ["small"] and mix.shares() == [40 / 120, 80 / 120]
    assert all(s == 1 for x in batches[-5:] for s, _ in x)
    assert mix.describe().endswith("; exhausted: small") and "epochs 1.00 of 1" in mix.describe()
    frac = MixtureOrder([100, 100], [1, 1], 1, 1, 0, 1, epochs=[1.5, 0.29])
    assert frac.caps == [150, 29] and frac.max_samples() == 179 and mix.max_samples() is None


def test_all_sources_exhausted_is_one_line_and_does_not_advance():
    mix = MixtureOrder([10, 6], [1, 1], 4, 1, 0, 2, epochs=[1, 1.0], names=["a", "b"])
    _steps([mix], 2)
    before = list(mix.consumed)
    with pytest.raises(DataError, match=r"^the data mixture is exhausted after 16 samples: a \(epochs 1\), "
                                        r"b \(epochs 1\) reached their epochs caps \(0 samples left, a step needs 8\); "
                                        r"raise the epochs caps or lower train.steps$"):
        mix.rows_for_step()
    assert mix.consumed == before


def test_a_weight_change_on_resume_applies_from_there_and_repeats_nothing():
    n, kw = [60, 45], dict(seed=4)
    first = _ranks(n, [3, 1], 4, 2, 2, **kw)
    head = _steps(first, 30)  # 480 samples at 3:1
    state = first[0].state_dict()
    later = _ranks(n, [1, 3], 8, 1, 2, state=state, **kw)
    tail = _steps(later, 10)
    new = [x for b in tail for x in b]
    assert sum(s == 1 for s, _ in new) == 120  # 160 samples at 1:3 from the resume step on, no catch-up burst
    assert later[0].base == state["consumed"].tolist()
    seen = set()  # (source, epoch, row) of every sample: none twice
    for i, rows in enumerate(_per_source(head + tail, 2)):
        for k, r in enumerate(rows):
            seen.add((i, k // n[i], r))
    assert len(seen) == 640
    # a second resume keeps the new weights' schedule exactly
    straight = _steps(_ranks(n, [1, 3], 4, 1, 4, state=state, **kw), 12)
    again = _ranks(n, [1, 3], 16, 1, 1, state=later[1].state_dict(), **kw)
    assert tail + _steps(again, 2) == straight
    longer = _steps(_ranks(n, [1, 3], 16, 1, 1, state=state, **kw), 200)
    shares = np.bincount([s for b in longer for s, _ in b], minlength=2) / (200 * 16)
    assert abs(shares[1] - 0.75) < 0.002


@pytest.mark.parametrize("weights", [[1, 0], [1, -1], [1, math.nan], [1, math.inf], [1], [1, 1, 1], [1, True]])
def test_bad_weights_are_one_clear_line(weights):
    with pytest.raises(ConfigError, match=r"^data mixture: .*(weights must be finite and > 0|give one per source)$"):
        MixtureOrder([10, 10], weights, 1, 1, 0, 1)


def test_other_bad_arguments():
    with pytest.raises(ConfigError, match="epochs 0"):
        MixtureOrder([10, 10], [1, 1], 1, 1, 0, 1, epochs=[1, 0])
    with pytest.raises(ConfigError, match="2 names for 1 sources"):
        MixtureOrder([10], [1], 1, 1, 0, 1, names=["a", "b"])
    with pytest.raises(ConfigError, match="no sources"):
        MixtureOrder([], [], 1, 1, 0, 1)
    with pytest.raises(DataError, match="source b has 0 rows"):
        MixtureOrder([10, 0], [1, 1], 1, 1, 0, 1, names=["a", "b"])


def test_load_refuses_old_orders_other_sources_and_single_source_states():
    mix = MixtureOrder([10, 10], [1, 1], 2, 1, 0, 1)
    mix.rows_for_step()
    state = mix.state_dict()
    fresh = MixtureOrder([10, 10], [1, 1], 2, 1, 0, 1)
    fresh.load_state_dict({"samples_seen": torch.tensor(0)})
    assert fresh.consumed == [0, 0]
    with pytest.raises(DataError, match="older shardlm"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != "order_version"})
    with pytest.raises(DataError, match="no per-source counts"):
        fresh.load_state_dict({"samples_seen": 4, "order_version": 2})
    with pytest.raises(DataError, match="has 2 sources, this run 3"):
        MixtureOrder([10, 10, 10], [1, 1, 1], 2, 1, 0, 1).load_state_dict(state)
    with pytest.raises(DataError, match="inconsistent"):
        fresh.load_state_dict({**state, "samples_seen": torch.tensor(5)})
    fresh.load_state_dict(state)
    assert fresh.rows_for_step() == mix.rows_for_step()
