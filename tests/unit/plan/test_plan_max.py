"""`shardlm plan --max KEY`: for each GPU size, the largest data.seq_len (steps of 128) or
train.micro_batch_size whose plan fits, checked against plans of the answer and of the next value."""

from __future__ import annotations

import re

import pytest

from shardlm.cli import main
from shardlm.config import load_config
from shardlm.errors import ConfigError
from shardlm.plan import GIB, plan, plan_max

BASE = ["--model.preset=debug", "--train.micro_batch_size=2", "--data.seq_len=256"]


def _need(overrides: list[str]) -> int:
    return plan(load_config(None, [*BASE, *overrides]), world_size=2, gpu_mem_gib=80, gpus_per_node=2,
                alternatives=False).base.peak_bytes


@pytest.mark.parametrize("key, step, anchors", [("data.seq_len", 128, (512, 2048)),
                                                 ("train.micro_batch_size", 1, (4, 16))])
def test_max_is_the_largest_value_that_fits(key, step, anchors):
    # GPU sizes just above what two anchor values need: the answers must lie at or above them
    sizes = [(_need([f"--{key}={a}"]) + 2**20) / 0.9 / GIB for a in anchors]
    rep = plan_max(load_config(None, BASE), key, world_size=2, sizes_gib=sizes, gpus_per_node=2)
    assert [r.gpu_mem_gib for r in rep.rows] == sizes
    for r, anchor in zip(rep.rows, anchors):
        assert r.value is not None and r.value >= anchor and not r.capped, (r, anchor)
        assert r.peak_bytes == _need([f"--{key}={r.value}"]) <= r.usable_bytes
        assert _need([f"--{key}={r.value + step}"]) > r.usable_bytes, r  # the next value does not fit
    assert rep.rows[0].value < rep.rows[1].value and len(rep.plans) < 20, rep.plans
    assert key in rep.format() and f"{rep.rows[1].value:,}" in rep.format()


def test_nothing_fits_a_tiny_gpu_and_the_cli(capsys):
    rep = plan_max(load_config(None, BASE), "data.seq_len", world_size=2, sizes_gib=[0.5], gpus_per_node=2)
    assert rep.rows[0].value is None and "none fits" in rep.format()  # the CUDA context alone is 0.49 GiB
    with pytest.raises(ConfigError, match="not searchable"):
        plan_max(load_config(None, BASE), "train.steps", world_size=2, sizes_gib=[80], gpus_per_node=2)
    assert main(["plan", "--gpu-mem-gib", "0.5,2", "--max", "data.seq_len", "--gpus-per-node", "2",
                 *BASE]) == 3  # the 0.5 GiB GPU fits nothing
    out = capsys.readouterr().out
    assert "largest data.seq_len" in out and "none fits" in out
    # the same search with context parallelism (2 GPUs per node: cp=2), below the one without. On 2 GiB it fits
    # nothing: CP's two more NCCL communicators (2 x 656 MiB) outweigh what the debug model's activations save
    # (on 6 GiB it goes from 77,184 tokens to 102,528: docs/long-context.md)
    without, with_cp = out.split("with parallel.cp=2 (each sequence split over 2 ranks; same ranks):")
    assert re.search(r"2 GiB\s+[\d,]+\s", without) and with_cp.count("none fits") == 2, out
    assert main(["plan", "--gpu-mem-gib", "24,48", "--gpus-per-node", "2", *BASE]) == 2  # a row needs --max
    assert "--gpu-mem-gib takes one size" in capsys.readouterr().err
    for bad in ("nan", "inf", "-8", "24,nan"):  # one line, exit 2: not a traceback
        assert main(["plan", "--gpu-mem-gib", bad, *BASE]) == 2
        err = capsys.readouterr().err
        assert "finite numbers of GiB > 0" in err and len(err.strip().splitlines()) == 1, err
