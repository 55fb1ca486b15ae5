"""Memory falls linearly: each rank's sharded parameters, gradients and AdamW state, measured from
the real local tensors, are total / N (within FSDP's dim-0 padding) on 1, 2 and 4 ranks."""

from __future__ import annotations

import pytest

from launch import run_ranks


def local_state_bytes(tmp: str, corpus: str) -> list[dict]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardlm.config import load_config
    from shardlm.trainer import Trainer

    t = Trainer(load_config(None, [
        "--train.mixed_precision=fp32", f"--train.output_dir={tmp}/run", f"--data.path={corpus}",
        "--data.seq_len=64", f"--data.cache_dir={tmp}/cache", "--train.micro_batch_size=1",
        "--metrics.progress_bar=false", "--checkpoint.resume=none"]))
    x, y = t.loader.next_step()[0]
    F.cross_entropy(t.model(x).flatten(0, 1), y.flatten()).backward()
    nbytes = lambda ts: sum(v.numel() * v.element_size() for v in ts)  # noqa: E731
    grads = nbytes(p.grad.to_local() for p in t.model.parameters())
    t.optimizer.step()
    moments = nbytes(v.to_local() for s in t.optimizer.state.values() for k, v in s.items() if k != "step")
    mine = {"params": nbytes(p.to_local() for p in t.model.parameters()), "grads": grads, "optim": moments,
            "total_params": sum(p.numel() for p in t.model.parameters()),
            "rows": [p.shape[0] for p in t.model.parameters()]}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


@pytest.fixture(scope="module")
def per_world(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("scaling")
    return {n: run_ranks(n, local_state_bytes, str(tmp / str(n)), str(corpus)) for n in (1, 2, 4)}


@pytest.mark.parametrize("n", [1, 2, 4])
def test_each_rank_holds_one_nth(per_world, n):
    ranks = per_world[n]
    full = 4 * ranks[0]["total_params"]  # fp32 bytes of the whole model
    # dim-0 padding: a rank holds at most ceil(rows / n) rows of each parameter
    slack = 4 * sum(ranks[0]["total_params"] / rows for rows in ranks[0]["rows"])
    for r in ranks:
        assert abs(r["params"] - full / n) <= slack, (n, r["params"], full / n)
        assert abs(r["grads"] - full / n) <= slack
        assert abs(r["optim"] - 2 * full / n) <= 2 * slack  # exp_avg + exp_avg_sq
    assert sum(r["params"] for r in ranks) == full  # together they hold the model exactly once


def test_memory_per_rank_halves_with_twice_the_ranks(per_world):
    per_rank = {n: max(r["params"] + r["grads"] + r["optim"] for r in per_world[n]) for n in (1, 2, 4)}
    assert per_rank[2] == pytest.approx(per_rank[1] / 2, rel=0.02)
    assert per_rank[4] == pytest.approx(per_rank[1] / 4, rel=0.03)
