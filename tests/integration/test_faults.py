"""Fault injection through the real CLI: SIGKILL a rank under torchrun --max-restarts, SIGTERM
(preemption) and Ctrl-C, to one process and to torchrun, and a kill in the middle of a save."""

from __future__ import annotations

import contextlib
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


def _signalled(tmp: Path, corpus: Path, name: str, nproc: int, send, **extra) -> tuple[int, str, list[int]]:
    """Start a long run, `send(p)` once 3 steps are logged; (exit code, log, complete checkpoint steps)."""
    run = tmp / name
    p = _start(_cmd(_args(tmp, corpus, name, 10_000, **extra), nproc=nproc), tmp / f"{name}.log")
    try:
        _wait_for(lambda: len(_records(run)) >= 3)
        send(p)
        code = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    saved = sorted(int(c.name.split("-")[1]) for c in (run / "checkpoints").glob("step-*"))
    return code, (tmp / f"{name}.log").read_text(), saved


def _no_worker_traceback(log: str) -> None:
    """torchrun may print its own traceback (SignalException); no frame of shardlm's, no KeyboardInterrupt."""
    frames = [line for line in log.splitlines() if line.strip().startswith('File "') and "shardlm" in line]
    assert not frames and "KeyboardInterrupt" not in log, log[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl_c"])
def test_signal_saves_and_exits(tmp_path, corpus, sig):
    """One process: SIGTERM -> save, exit 0; Ctrl-C -> save, exit 130 and one line."""
    code, log, saved = _signalled(tmp_path, corpus, "one", 0, lambda p: p.send_signal(sig))
    assert len(saved) == 1 and saved[0] >= 3, saved
    if sig == signal.SIGTERM:
        assert code == 0, log[-3000:]
        assert f"preempted (SIGTERM): checkpoint at step {saved[0]} saved" in log
    else:
        assert code == 130, log[-3000:]
        assert log.splitlines()[-1] == f"shardlm: interrupted at step {saved[0]}; last complete checkpoint step-{saved[0]}"
        assert "preempted (SIGTERM)" not in log
        _no_worker_traceback(log)


def test_sigterm_to_torchrun_saves_every_rank_and_torchrun_exits_1(tmp_path, corpus):
    # What Kubernetes does: SIGTERM to the launcher, which forwards it to the ranks. The ranks save
    # and exit 0; torchrun itself re-raises the signal as SignalException: a traceback and exit 1.
    code, log, saved = _signalled(tmp_path, corpus, "pre2", 2, lambda p: p.send_signal(signal.SIGTERM))
    assert code == 1, log[-3000:]
    assert len(saved) == 1, saved
    assert f"preempted (SIGTERM): checkpoint at step {saved[0]} saved" in log
    assert "exitcode" not in log  # torchrun reports no worker failure: they exited 0
    _no_worker_traceback(log)


def test_ctrl_c_to_torchrun_saves_and_prints_one_line(tmp_path, corpus):
    # Ctrl-C in a terminal: SIGINT to the foreground process group. torchrun's workers have sessions
    # of their own, so only torchrun gets it and forwards SIGINT to each of them.
    code, log, saved = _signalled(tmp_path, corpus, "int2", 2, lambda p: os.killpg(p.pid, signal.SIGINT))
    assert code == 1, log[-3000:]  # torchrun's own exit code (SignalException); the ranks exit 130
    assert len(saved) == 1, saved
    line = f"shardlm: interrupted at step {saved[0]}; last complete checkpoint step-{saved[0]}"
    assert [x for x in log.splitlines() if x.startswith("shardlm: interrupted")] == [line], log[-3000:]
    assert "preempted (SIGTERM)" not in log
    _no_worker_traceback(log)


@pytest.mark.parametrize("nproc", [0, 2], ids=["one_process", "torchrun"])
def test_second_ctrl_c_drops_the_save_in_flight(tmp_path, corpus, nproc):
    """A second Ctrl-C while the stop's checkpoint is written ends at once, the last complete one named.
    Under torchrun it arrives as SIGTERM: torchrun answers a second SIGINT by sending its workers SIGTERM."""
    big = {"model.dim": 512, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_dim": 2048,
           "checkpoint.interval": 2, "checkpoint.keep_last": 0}  # ~16M params: a save takes a moment
    ckdir = tmp_path / "twice" / "checkpoints"
    p = _start(_cmd(_args(tmp_path, corpus, "twice", 10_000, **big), nproc=nproc), tmp_path / "twice.log")
    try:
        _wait_for(lambda: (ckdir / "step-2").is_dir())
        _wait_for(lambda: not list(ckdir.glob(".step-*.partial")), every=0.002)
        os.killpg(p.pid, signal.SIGINT)
        _wait_for(lambda: list(ckdir.glob(".step-*.partial")), every=0.002)  # the next save is being written
        os.killpg(p.pid, signal.SIGINT)
        t0 = time.monotonic()
        code = p.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    log = (tmp_path / "twice.log").read_text()
    assert code == (130 if nproc == 0 else 1), log[-3000:]
    assert took < 5, took
    complete = sorted(int(c.name.split("-")[1]) for c in ckdir.glob("step-*"))
    (partial,) = ckdir.glob(".step-*.partial")
    dropped = int(partial.name.split("-")[1].split(".")[0])
    assert dropped not in complete and dropped > complete[-1], (complete, partial)
    lines = [x for x in log.splitlines() if x.startswith("shardlm: interrupted")]
    line = (f"shardlm: interrupted at step {dropped}; last complete checkpoint step-{complete[-1]} "
            "(a second Ctrl-C: the save in progress was dropped)")
    assert lines == [line], log[-3000:]
    _no_worker_traceback(log)


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


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaps (an orphan's new parent may not)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def test_ranks_whose_launcher_died_stop_with_one_line(tmp_path, corpus):
    """torchrun's agent SIGKILLed (its node lost its launcher): the ranks it started are orphans that nothing
    will stop; each sees its parent change and stops within a heartbeat or two with one line (exit 8)."""
    run = tmp_path / "orphan"
    p = _start(_cmd(_args(tmp_path, corpus, "orphan", 10_000), nproc=2), tmp_path / "orphan.log")
    try:
        _wait_for(lambda: len(_records(run)) >= 2)
        workers = _children(p.pid)
        assert len(workers) == 2, workers
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        _wait_for(lambda: all(_gone(w) for w in workers), timeout=30)
        took = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):  # the session: also any rank that did not stop
            os.killpg(p.pid, signal.SIGKILL)
    log = (tmp_path / "orphan.log").read_text()
    lines = [x for x in log.splitlines() if "its launcher" in x]
    assert len(lines) == 2, log[-3000:]
    for rank in (0, 1):
        line = next(x for x in lines if x.startswith(f"shardlm: error: rank {rank}: step "))
        assert f"its launcher (pid {p.pid}, the torchrun agent) is gone, so nothing would stop or restart this " \
               "rank with its peers: stopping it; no checkpoint was saved yet: a restart begins at step 0" in line, line
    assert took < 15, took  # a heartbeat (1 s) or two, not minutes
