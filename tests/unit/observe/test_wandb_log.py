"""observe/wandb_log.py under WANDB_MODE=offline: the scalars, the config and the run id as W&B wrote them,
read back from its transaction log (<output_dir>/wandb/offline-run-*/run-<id>.wandb)."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest

from shardlm.errors import ConfigError
from shardlm.observe.wandb_log import WandbLogger


@pytest.fixture
def offline(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.delenv("WANDB_RESUME", raising=False)


def read_run(path: Path, wait_s: float = 30.0) -> dict:
    """A finished run's .wandb file: {"run": RunRecord, "config": {...}, "history": {step: {key: value}}}.
    wandb-core writes it behind `finish()`'s back: wait (up to `wait_s`) for its exit record."""
    deadline = time.monotonic() + wait_s
    records = _records(path)
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, f"{path}: no exit record after {wait_s}s"
        time.sleep(0.05)
        records = _records(path)
    out = {"run": None, "config": {}, "history": {}}

    def key(item) -> str:
        return item.key or "/".join(item.nested_key)

    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["run"] = r.run
            out["config"].update({key(i): json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            out["config"].update({key(i): json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            out["history"][r.history.step.num] = {key(i): json.loads(i.value_json) for i in r.history.item}
    return out


def _records(path: Path) -> list:
    """The protobuf Records of a .wandb file (LevelDB log format: 32 KiB blocks of checksum/length/type-framed
    chunks after a 7-byte W&B header); a record cut short at the end (still being written) is left out."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes() if path.exists() else b"", 32768
    if not data:
        return []
    assert data[:4] == b":W&B", path
    pos, chunk, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left for a header: padding to the next block
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        piece = data[pos + 7:pos + 7 + length]
        if len(piece) < length:  # the end of what is written so far
            break
        chunk += piece
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            records.append(pb.Record.FromString(chunk))
            chunk = b""
    return records


def _record(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_sec": 1000.0, "mfu": None,
            "time_data_s": 0.01}


def _train_keys(history: dict) -> dict:
    return {s: {k: v for k, v in h.items() if k.startswith("train/")} for s, h in history.items()}


def test_offline_run_holds_the_scalars_and_a_resume_continues_it(offline, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    cfg = {"train": {"steps": 2, "lr": 1e-3}, "metrics": {"wandb": True}}
    w = WandbLogger(out, cfg, "shardlm-test", "demo", enabled=True, resumed=False)
    for step in (1, 2):
        w.log(_record(step, 3.0 - step), step)
    w.finish()
    w.finish()  # twice: nothing
    run_id = (out / "wandb_id").read_text().strip()
    assert w.id is None and len(run_id) == 8
    [first] = (out / "wandb").glob(f"offline-run-*-{run_id}")
    got = read_run(first / f"run-{run_id}.wandb")
    assert (got["run"].run_id, got["run"].project, got["run"].display_name) == (run_id, "shardlm-test", "demo")
    assert got["config"]["train"] == {"steps": 2, "lr": 1e-3} and got["config"]["metrics"] == {"wandb": True}
    scalars = {"train/lr": 1e-3, "train/grad_norm": 0.5, "train/tokens_per_sec": 1000.0, "train/time_data_s": 0.01}
    assert _train_keys(got["history"]) == {1: {"train/loss": 2.0, **scalars}, 2: {"train/loss": 1.0, **scalars}}

    # Resumed from a checkpoint with train.steps raised: the same W&B run (a second offline part of it).
    w = WandbLogger(out, {**cfg, "train": {"steps": 3, "lr": 1e-3}}, "shardlm-test", "demo", enabled=True,
                    resumed=True)
    assert w.id == run_id
    w.log(_record(3, 0.5), 3)
    w.finish()
    [second] = set((out / "wandb").glob(f"offline-run-*-{run_id}*")) - {first}
    got = read_run(second / f"run-{run_id}.wandb")
    assert got["run"].run_id == run_id and got["config"]["train"]["steps"] == 3
    assert _train_keys(got["history"]) == {3: {"train/loss": 0.5, **scalars}}

    # A fresh start in the same folder is a new W&B run.
    w = WandbLogger(out, cfg, "shardlm-test", None, enabled=True, resumed=False)
    assert w.id != run_id and (out / "wandb_id").read_text().strip() == w.id
    w.finish()


def test_other_ranks_do_nothing(offline, tmp_path):
    w = WandbLogger(tmp_path, {}, "p", "n", enabled=False)
    w.log(_record(1, 1.0), 1)
    w.finish()
    assert w.id is None and list(tmp_path.iterdir()) == []


def test_a_step_logged_before_the_restart_is_said_once():
    class Run:
        id, step = "abc", 9  # W&B's next step: steps 6-8 were logged before the checkpoint at 5 was resumed

        def __init__(self):
            self.logged = []

        def log(self, data, step):
            self.logged.append(step)

    lines = []
    w = WandbLogger("unused", {}, "p", "n", enabled=False, log=lines.append)
    w.run = Run()
    for step in (6, 7, 8, 9):
        w.log(_record(step, 1.0), step)
    assert w.run.logged == [9] and w.repeated == [6, 7, 8]
    assert lines == ["wandb: step 6 was logged to W&B run abc before the restart (it is at step 8); "
                     "W&B keeps the first values up to there"]


@pytest.mark.parametrize("enabled", [True, False])
def test_without_wandb_every_rank_stops_with_one_line(monkeypatch, tmp_path, enabled):
    for name in [n for n in sys.modules if n == "wandb" or n.startswith("wandb.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError) as e:
        WandbLogger(tmp_path, {}, "p", "n", enabled=enabled)
    assert str(e.value) == "metrics.wandb=true needs wandb (not installed): pip install 'shardlm[wandb]'"
    assert list(tmp_path.iterdir()) == []
