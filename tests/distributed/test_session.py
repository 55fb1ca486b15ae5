"""The run's session: everything a Trainer takes (process group, watchdog, signal handlers, folder locks) is
given back by close(), also after a start that failed part way, so that a second Trainer in the same process
starts and trains as the first did (on 2 and 4 gloo ranks)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from helpers.launch import run_ranks
from helpers.threads import thread_names

TINY = ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=2", "--model.ffn_dim=64",
        "--data.seq_len=32", "--train.micro_batch_size=2", "--train.steps=2", "--metrics.log_every=1",
        "--metrics.progress_bar=false", "--eval.at_end=false"]


def _left(out: Path) -> dict:
    """What a closed run may not leave behind: a process group, gloo threads, our signal handlers, a lock."""
    import torch.distributed as dist

    return {"group": dist.is_initialized(), "gloo": [n for n in thread_names() if "gloo" in n],
            "sigterm": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
            "locks": sorted(str(p.relative_to(out)) for p in out.rglob("*.lock"))}


def _three_starts(out: str) -> dict:
    from shardlm.config import load_config
    from shardlm.errors import DataError
    from shardlm.train.trainer import Trainer

    out_p = Path(out)

    class FailsAfterJoining(Trainer):
        def build_data(self):  # the process group, watchdog, handlers and locks are all taken by now
            raise DataError("no data (on purpose)")

    seen: dict = {}
    with pytest.raises(DataError, match="on purpose"):
        FailsAfterJoining(load_config(None, [*TINY, f"--train.output_dir={out}/failed"]))
    seen["after_failed_start"] = _left(out_p)
    for name in ("first", "second"):
        t = Trainer(load_config(None, [*TINY, f"--train.output_dir={out}/{name}"]))
        seen[f"during_{name}"] = _left(out_p)
        seen[name] = [r["loss"] for r in t.train()]
        t.close()
        seen[f"after_{name}"] = _left(out_p)
    return seen


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
@pytest.mark.parametrize("world", [2, 4])
def test_close_then_start_again_in_one_process(tmp_path, world):
    seen = run_ranks(world, _three_starts, str(tmp_path))
    clean = {"group": False, "gloo": [], "sigterm": True, "locks": []}
    for when in ("after_failed_start", "after_first", "after_second"):
        assert seen[when] == clean, (when, seen[when])
    assert seen["during_first"]["group"] and not seen["during_first"]["sigterm"]  # the checks see what is held
    assert seen["during_first"]["locks"] == ["first/.shardlm.lock"] and seen["during_second"]["locks"] == ["second/.shardlm.lock"]
    assert len(seen["first"]) == 2 and seen["second"] == seen["first"]  # the same run, started afresh
    assert (tmp_path / "second" / "checkpoints" / "step-2").is_dir()
