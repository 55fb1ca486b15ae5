"""Teardown: after Trainer.close() no backend thread is left for interpreter shutdown to trip over.

destroy_process_group() alone leaves the gloo worker threads alive while a DeviceMesh or the FSDP
state holds the group; they then die during interpreter finalization and, now and then, abort a
run that had finished ("terminate called without an active exception", SIGABRT, seen in CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from launch import run_ranks

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")


def _threads() -> list[str]:
    return sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))


def _gloo(names: list[str]) -> list[str]:
    return [n for n in names if "gloo" in n]


def _train_and_close(overrides: list[str]) -> dict:
    from shardlm.config import load_config
    from shardlm.train.trainer import Trainer

    t = Trainer(load_config(None, overrides))
    t.train()
    before = _threads()
    t.close()  # `t` stays referenced here on purpose: close() alone must free the groups
    return {"before": before, "after": _threads(), "model_released": t.model is None}


def _mesh_only() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from shardlm.distributed.env import shutdown_distributed

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    before = _threads()
    shutdown_distributed()
    return {"before": before, "after": _threads(), "mesh_alive": mesh is not None}


@pytest.mark.parametrize("async_", [False, True])
def test_trainer_close_ends_every_gloo_thread(tmp_path, corpus, async_):
    o = {"model.preset": "debug", "train.steps": 2, "train.output_dir": tmp_path / "run", "train.micro_batch_size": 1,
         "data.path": corpus, "data.seq_len": 64, "data.cache_dir": tmp_path / "cache", "metrics.progress_bar": False,
         "checkpoint.interval": 1, "checkpoint.async": async_, "train.sample_tokens": 0}
    got = run_ranks(2, _train_and_close, [f"--{k}={v}" for k, v in o.items()])
    assert _gloo(got["before"]), got["before"]  # the check is live: gloo threads ran during training
    assert _gloo(got["after"]) == [], got["after"]
    assert got["model_released"]


def test_shutdown_frees_groups_a_live_mesh_still_holds():
    got = run_ranks(2, _mesh_only)
    assert got["mesh_alive"] and _gloo(got["before"])
    assert _gloo(got["after"]) == [], got["after"]
