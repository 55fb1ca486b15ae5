from __future__ import annotations

import pytest
import torch

from shardlm.config import load_config
from shardlm.errors import ConfigError
from shardlm.parallel.dims import ParallelDims
from shardlm.train.optim import build_lr_scheduler, lr_factor


def test_parallel_dims_fill_and_validate():
    assert ParallelDims(1, -1, 8).dp_shard == 8
    d = ParallelDims(2, -1, 8)
    assert (d.dp_replicate, d.dp_shard, d.dp, d.hsdp) == (2, 4, 8, True)
    with pytest.raises(ConfigError, match=r"2 x parallel.dp_shard=3 = 6 ranks, but the world size is 4"):
        ParallelDims(2, 3, 4)
    with pytest.raises(ConfigError, match="does not divide the world size 4"):
        ParallelDims(3, -1, 4)


def test_warmup_then_cosine_to_min():
    t = load_config(None, ["--train.steps=110", "--train.warmup_steps=10", "--train.min_lr_ratio=0.1"]).train
    f = [lr_factor(s, t) for s in range(110)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(f[:10], f[1:10]))
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[60] == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(110, t) == pytest.approx(0.1)


def test_linear_and_constant_schedules():
    lin = load_config(None, ["--train.steps=20", "--train.warmup_steps=0", "--train.lr_schedule=linear",
                             "--train.min_lr_ratio=0"]).train
    assert [lr_factor(s, lin) for s in (0, 10, 20)] == pytest.approx([1.0, 0.5, 0.0])
    const = load_config(None, ["--train.warmup_steps=0", "--train.lr_schedule=constant"]).train
    assert lr_factor(50, const) == 1.0


def test_scheduler_drives_optimizer_lr():
    t = load_config(None, ["--train.steps=4", "--train.warmup_steps=2", "--train.lr=1.0"]).train
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=t.lr)
    sched = build_lr_scheduler(opt, t)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_factor(s, t) for s in range(4)])


def test_extending_train_steps_goes_on_from_the_current_lr():
    from shardlm.train.optim import extended_anchor

    t100 = load_config(None, ["--train.steps=100", "--train.warmup_steps=10"]).train
    t200 = load_config(None, ["--train.steps=200", "--train.warmup_steps=10"]).train
    anchor = extended_anchor(60, t200, saved_steps=100, saved=None)
    at60 = lr_factor(60, t100)
    assert lr_factor(60, t200) > at60 + 0.2  # without the anchor: a jump back up
    f = [lr_factor(s, t200, anchor) for s in range(60, 201)]
    assert f[0] == pytest.approx(at60) and f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f, f[1:]))  # continuous and decaying, no jump
    # Extended twice: the second anchor starts where the first schedule had got to.
    t300 = load_config(None, ["--train.steps=300", "--train.warmup_steps=10"]).train
    again = extended_anchor(150, t300, saved_steps=200, saved=anchor)
    assert lr_factor(150, t300, again) == pytest.approx(lr_factor(150, t200, anchor))
    assert extended_anchor(60, t100, saved_steps=100, saved=anchor) == anchor  # same steps: as saved
    assert extended_anchor(5, t200, saved_steps=100, saved=None) is None  # in warmup: nothing to anchor
