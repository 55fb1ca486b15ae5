"""Fault injection through the real CLI: SIGKILL a rank under torchrun --max-restarts, SIGTERM
(preemption), and a kill in the middle of a save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug.toml")
pytestmark = pytest.mark.slow


def _cmd(args: list[str], nproc: int = 0, restarts: int = 0) -> list[str]:
    if not nproc:
        return [sys.executable, "-m", "shardlm", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            f"--max-restarts={restarts}", "-m", "shardlm", *args]


# torchrun's shared rendezvous store hands restarted workers the previous round's addresses
# (pytorch#135712); the README tells users to set this with --max-restarts, and so do we.
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = ENV
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)


def _wait_for(pred, timeout: float = 120.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError("timed out waiting")


def _records(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    if not f.exists():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _args(tmp: Path, corpus: Path, run: str, steps: int, **extra) -> list[str]:
    o = {"data.path": corpus, "data.seq_len": 64, "data.cache_dir": tmp / "cache", "train.micro_batch_size": 2,
         "train.output_dir": tmp / run, "train.steps": steps, "train.warmup_steps": 5, "metrics.log_every": 1}
    o.update(extra)
    return ["train", "--config", DEBUG, *[f"--{k}={v}" for k, v in o.items()]]


def test_sigkill_one_rank_restarts_and_matches_uninterrupted(tmp_path, corpus):
    steps = 20
    ref = subprocess.run(_cmd(_args(tmp_path, corpus, "ref", steps), nproc=2), capture_output=True, text=True,
                         cwd=ROOT, timeout=300, env=ENV)
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]
    run = tmp_path / "faulty"
    p = _start(_cmd(_args(tmp_path, corpus, "faulty", steps, **{"checkpoint.interval": 5}), nproc=2, restarts=1),
               tmp_path / "faulty.log")
    try:
        _wait_for(lambda: (run / "checkpoints" / "step-10").is_dir() and len(_records(run)) >= 12)
        workers = _children(p.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)  # one rank dies mid-run
        assert p.wait(timeout=300) == 0, (tmp_path / "faulty.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    log = (tmp_path / "faulty.log").read_text()
    assert "checkpoint: resumed from" in log
    recs, ref_recs = _records(run), _records(tmp_path / "ref")
    assert [r["step"] for r in recs] == list(range(1, steps + 1))  # the log was rewound, not duplicated
    assert recs[-1]["loss"] == ref_recs[-1]["loss"]
    assert [r["loss"] for r in recs] == [r["loss"] for r in ref_recs]


def test_sigterm_saves_and_exits_zero(tmp_path, corpus):
    run = tmp_path / "pre"
    p = _start(_cmd(_args(tmp_path, corpus, "pre", 10_000)), tmp_path / "pre.log")
    try:
        _wait_for(lambda: len(_records(run)) >= 3)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    log = (tmp_path / "pre.log").read_text()
    saved = sorted(int(c.name.split("-")[1]) for c in (run / "checkpoints").glob("step-*"))
    assert len(saved) == 1 and saved[0] >= 3, saved
    assert f"preempted (SIGTERM): checkpoint at step {saved[0]} saved" in log


def test_sigterm_to_torchrun_checkpoints_every_rank(tmp_path, corpus):
    run = tmp_path / "pre2"
    p = _start(_cmd(_args(tmp_path, corpus, "pre2", 10_000), nproc=2), tmp_path / "pre2.log")
    try:
        _wait_for(lambda: len(_records(run)) >= 3)
        p.send_signal(signal.SIGTERM)  # what Kubernetes does: the launcher forwards it to the ranks
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    log = (tmp_path / "pre2.log").read_text()
    (ck,) = (run / "checkpoints").glob("step-*")
    assert f"preempted (SIGTERM): checkpoint at step {ck.name.split('-')[1]} saved" in log
    assert "exitcode" not in log  # torchrun reports no worker failure: they exited 0


def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path, corpus):
    big = {"model.dim": 512, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_dim": 2048,
           "checkpoint.interval": 2, "checkpoint.keep_last": 0}  # ~15M params: a save takes a moment
    ckdir = tmp_path / "kill" / "checkpoints"
    p = _start(_cmd(_args(tmp_path, corpus, "kill", 10_000, **big)), tmp_path / "kill.log")
    try:
        _wait_for(lambda: (ckdir / "step-2").is_dir())
        _wait_for(lambda: list(ckdir.glob(".step-*.partial")), every=0.002)
        os.killpg(p.pid, signal.SIGKILL)  # mid-save
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    complete = sorted(c.name for c in ckdir.glob("step-*"))
    (partial,) = ckdir.glob(".step-*.partial")
    assert f"step-{partial.name.split('-')[1].split('.')[0]}" not in complete
    again = subprocess.run(_cmd(_args(tmp_path, corpus, "kill", int(complete[-1].split("-")[1]) + 1, **big)),
                           capture_output=True, text=True, cwd=ROOT, timeout=300, env=ENV)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"removing incomplete {partial.name}" in again.stdout
    assert f"resumed from {ckdir / complete[-1]}" in again.stdout
    assert not partial.exists()
