"""Teardown: after Trainer.close() no backend thread is left for interpreter shutdown to trip over;
also after a Ctrl-C, in the loop (on one rank: every rank stops) or during setup.

destroy_process_group() alone leaves the gloo worker threads alive while a DeviceMesh or the FSDP
state holds the group; they then die during interpreter finalization and, now and then, abort a
run that had finished ("terminate called without an active exception", SIGABRT, seen in CI)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from helpers.launch import run_ranks
from helpers.threads import thread_names

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")


def _threads() -> list[str]:
    return thread_names()


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


def _ctrl_c(overrides: list[str], out: Path) -> dict:
    """Ctrl-C reaches rank 0 alone during step 2, through `train()` as the CLI calls it; then a Ctrl-C
    during setup. Each rank records what it raised and which threads and signal handlers are left."""
    import torch.distributed as dist

    from shardlm.config import load_config
    from shardlm.errors import Interrupted
    from shardlm.train import trainer as tr

    rank = int(os.environ["RANK"])

    class CtrlC(tr.Trainer):
        def train_step(self, batches, stop_requested=False):
            if self.step == 1 and rank == 0:
                os.kill(os.getpid(), signal.SIGINT)  # the handler runs before os.kill returns
            return super().train_step(batches, self.preemption.requested)

    class CtrlCInSetup(tr.Trainer):
        def build_data(self):
            dist.barrier()  # both ranks are inside the process group when it comes
            raise KeyboardInterrupt

    got = {}
    for name, cls in [("loop", CtrlC), ("setup", CtrlCInSetup)]:
        tr.Trainer = cls
        try:
            tr.train(load_config(None, overrides))
            got[name] = "returned"
        except Interrupted as e:
            got[name] = str(e)
        got[f"{name}_gloo"] = _gloo(_threads())
        got[f"{name}_handlers"] = [signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                                   signal.getsignal(signal.SIGTERM) is signal.SIG_DFL]
    (out / f"rank{rank}.json").write_text(json.dumps(got))
    return got


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


def test_ctrl_c_on_one_rank_stops_every_rank_and_frees_the_groups(tmp_path, corpus):
    o = {"model.preset": "debug", "train.steps": 50, "train.output_dir": tmp_path / "run", "train.micro_batch_size": 1,
         "data.path": corpus, "data.seq_len": 64, "data.cache_dir": tmp_path / "cache", "metrics.progress_bar": False,
         "train.sample_tokens": 0}
    run_ranks(2, _ctrl_c, [f"--{k}={v}" for k, v in o.items()], tmp_path)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-2"]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["loop"] == "interrupted at step 2; last complete checkpoint step-2", (rank, got)
        assert got["setup"] == "interrupted during setup; last complete checkpoint step-2", (rank, got)
        for name in ("loop", "setup"):
            assert got[f"{name}_gloo"] == [] and got[f"{name}_handlers"] == [True, True], (rank, name, got)


def test_shutdown_frees_groups_a_live_mesh_still_holds():
    got = run_ranks(2, _mesh_only)
    assert got["mesh_alive"] and _gloo(got["before"])
    assert _gloo(got["after"]) == [], got["after"]
