"""Sharded == unsharded: FSDP on 2 and 4 ranks and HSDP 2x2 train exactly like 1 rank (fp32, gloo),
and k accumulation micro-batches equal one batch k times larger."""

from __future__ import annotations

import pytest
import torch
from helpers.launch import run_ranks
from helpers.whole import local, whole

STEPS = 10
SHORT = 5  # the 4-rank accumulation runs (4 processes on 2 cores are the slow part)
REL_TOL = 1e-5


def _overrides(tmp, corpus, tag, mbs, accum, **extra):
    o = {"model.preset": "debug", "train.steps": STEPS, "train.output_dir": f"{tmp}/{tag}",
         "train.mixed_precision": "fp32", "train.micro_batch_size": mbs, "train.grad_accum": accum,
         "train.lr": 3e-3, "train.warmup_steps": 3, "data.path": str(corpus), "data.seq_len": 64,
         "data.cache_dir": f"{tmp}/cache", "metrics.log_every": 1, "metrics.progress_bar": False,
         "checkpoint.save_final": False}
    o.update(extra)
    return [f"--{k}={v}" for k, v in o.items()]


def train_runs(runs: dict[str, list[str]]) -> dict[str, dict]:
    """Train each config in turn on the current ranks; per run: losses, grad norms, a weight checksum."""
    from shardlm.config import load_config
    from shardlm.models import Transformer
    from shardlm.train.trainer import Trainer

    out = {}
    for tag, overrides in runs.items():
        t = Trainer(load_config(None, overrides))
        # The sharded init must equal a plain, unsharded init with the same seed, bit for bit.
        with torch.device("meta"):
            ref = Transformer(t.model_cfg)
        ref.to_empty(device="cpu")
        ref.init_weights(seed=t.cfg.train.seed)
        ref_params = dict(ref.named_parameters())
        init_diff = max((whole(p) - ref_params[n]).abs().max().item() for n, p in t.model.named_parameters())
        recs = t.train()
        out[tag] = {"loss": [r["loss"] for r in recs], "grad_norm": [r["grad_norm"] for r in recs],
                    "weights": {n: whole(p).double().sum().item() for n, p in t.model.named_parameters()},
                    "init_diff": init_diff, "local_bytes": local_state_bytes(t)}
    return out


def local_state_bytes(t) -> list[dict]:
    """Every rank's bytes of sharded params, grads (after one more backward) and AdamW moments,
    summed from the real local tensors."""
    import torch.distributed as dist
    import torch.nn.functional as F

    x, y = t.loader.next_step()[0]
    F.cross_entropy(t.model(x).flatten(0, 1), y.flatten()).backward()
    nbytes = lambda ts: sum(v.numel() * v.element_size() for v in ts)  # noqa: E731
    mine = {"params": nbytes(local(p) for p in t.model.parameters()),
            "grads": nbytes(local(p.grad) for p in t.model.parameters()),
            "optim": nbytes(local(v) for s in t.optimizer.state.values() for k, v in s.items() if k != "step")}
    t.optimizer.zero_grad(set_to_none=True)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


@pytest.fixture(scope="module")
def results(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("equiv")
    one = run_ranks(1, train_runs, {
        "1rank": _overrides(tmp, corpus, "1rank", mbs=4, accum=1),
        "1rank_accum4": _overrides(tmp, corpus, "1rank_accum4", mbs=1, accum=4),
        "1rank_again": _overrides(tmp, corpus, "1rank_again", mbs=4, accum=1),
        "1rank_b8": _overrides(tmp, corpus, "1rank_b8", mbs=8, accum=1, **{"train.steps": SHORT}),
    })
    two = run_ranks(2, train_runs, {
        "fsdp2": _overrides(tmp, corpus, "fsdp2", mbs=2, accum=1),
        "fsdp2_accum2": _overrides(tmp, corpus, "fsdp2_accum2", mbs=1, accum=2),
        "fsdp2_accum2_step": _overrides(tmp, corpus, "fsdp2_accum2_step", mbs=1, accum=2,
                                        **{"train.grad_sync": "step"}),
    })
    four = run_ranks(4, train_runs, {
        "fsdp4": _overrides(tmp, corpus, "fsdp4", mbs=1, accum=1),
        "hsdp2x2": _overrides(tmp, corpus, "hsdp2x2", mbs=1, accum=1, **{"parallel.dp_replicate": 2}),
        # 2x2 HSDP with accumulation: the all-reduce deferred to the last micro-batch (micro_batch), or all
        # gradient sync deferred (step); both equal one rank with the whole batch of 8
        "hsdp2x2_accum2": _overrides(tmp, corpus, "hsdp2x2_accum2", mbs=1, accum=2,
                                     **{"parallel.dp_replicate": 2, "train.steps": SHORT}),
        "hsdp2x2_accum2_step": _overrides(tmp, corpus, "hsdp2x2_accum2_step", mbs=1, accum=2,
                                          **{"parallel.dp_replicate": 2, "train.grad_sync": "step",
                                             "train.steps": SHORT}),
    })
    return {**one, **two, **four}


def _assert_same(a: list[float], b: list[float], what: str, steps: int = STEPS) -> None:
    assert len(a) == len(b) == steps, what
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= REL_TOL * abs(x), f"{what}: step {i + 1}: {x} vs {y}"


@pytest.mark.parametrize("tag", ["fsdp2", "fsdp4", "hsdp2x2"])
def test_sharded_losses_equal_one_rank(results, tag):
    ref = results["1rank"]
    _assert_same(ref["loss"], results[tag]["loss"], f"{tag} loss")
    _assert_same(ref["grad_norm"], results[tag]["grad_norm"], f"{tag} grad norm")
    for name, v in ref["weights"].items():
        assert results[tag]["weights"][name] == pytest.approx(v, rel=1e-4, abs=1e-4), name


@pytest.mark.parametrize("tag, ref", [("1rank_accum4", "1rank"), ("fsdp2_accum2", "1rank"),
                                      ("fsdp2_accum2_step", "1rank"),
                                      ("hsdp2x2_accum2", "1rank_b8"), ("hsdp2x2_accum2_step", "1rank_b8")])
def test_accumulation_equals_bigger_batch(results, tag, ref):
    """Both train.grad_sync modes: reduce-scatter per micro-batch (HSDP: all-reduce on the last) or per step."""
    steps = len(results[ref]["loss"])
    _assert_same(results[ref]["loss"], results[tag]["loss"], f"{tag} loss", steps)
    _assert_same(results[ref]["grad_norm"], results[tag]["grad_norm"], f"{tag} grad norm", steps)


def test_same_seed_same_run_bitwise(results):
    assert results["1rank_again"]["loss"] == results["1rank"]["loss"]
    assert results["1rank_again"]["weights"] == results["1rank"]["weights"]


def test_loss_falls(results):
    loss = results["1rank"]["loss"]
    assert loss[-1] < loss[0] - 0.5, loss


@pytest.mark.parametrize("tag", ["1rank", "fsdp2", "fsdp4", "hsdp2x2"])
def test_sharded_init_equals_unsharded_init(results, tag):
    assert results[tag]["init_diff"] == 0.0


@pytest.mark.parametrize("tag, n", [("1rank", 1), ("fsdp2", 2), ("fsdp4", 4)])
def test_each_rank_holds_one_nth_of_the_state(results, tag, n):
    """Memory falls linearly: params, grads and AdamW moments per rank are total / N (within FSDP's
    dim-0 padding: at most one row of each parameter more), and together exactly the model once."""
    from shardlm.models import PRESETS

    cfg = PRESETS["debug"]
    full = 4 * cfg.num_params()
    with torch.device("meta"):
        from shardlm.models import Transformer

        rows = [p.shape[0] for p in Transformer(cfg).parameters()]
    slack = 4 * sum(cfg.num_params() / r for r in rows)  # generous: one row of every parameter
    ranks = results[tag]["local_bytes"]
    assert len(ranks) == n
    for r in ranks:
        assert abs(r["params"] - full / n) <= slack and abs(r["grads"] - full / n) <= slack
        assert abs(r["optim"] - 2 * full / n) <= 2 * slack
    assert sum(r["params"] for r in ranks) == full
