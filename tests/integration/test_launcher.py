"""`shardlm train --nproc-per-node N`: the ranks started through torch's elastic agent (as torchrun does), and
every failure kept to one line per failed rank with the error's own exit code (torchrun adds its
ChildFailedError block and a traceback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardlm.cli import main
from shardlm.distributed.launcher import summarize

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug.toml")
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _args(tmp: Path, corpus: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "shardlm", "train", "--config", DEBUG, "--nproc-per-node", "2",
            f"--data.path={corpus}", "--data.seq_len=64", f"--data.cache_dir={tmp / 'cache'}",
            "--train.micro_batch_size=2", f"--train.output_dir={tmp / 'run'}", "--metrics.log_every=1", *extra]


def _records(run: Path) -> int:
    f = run / "metrics.jsonl"
    return len(f.read_text().splitlines()) if f.exists() else 0


def _workers(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def test_a_failing_run_is_one_line_with_its_exit_code(tmp_path, corpus):
    """Divergence on both ranks (TrainingError, exit 6): the same line from each, printed once; torchrun's
    failure block and traceback do not appear."""
    p = subprocess.run(_args(tmp_path, corpus, "--train.steps=20", "--train.lr=1e6", "--train.grad_clip=0",
                             "--train.warmup_steps=0"), capture_output=True, text=True, env=ENV, timeout=300,
                       cwd=ROOT)
    assert p.returncode == 6, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardlm: error: non-finite optimizer step "), p.stderr[-3000:]
    assert "ChildFailedError" not in p.stderr + p.stdout and "Traceback" not in p.stderr
    assert "2 rank(s) on cpu (gloo)" in p.stdout  # the ranks ran as under torchrun


def test_a_killed_rank_and_ctrl_c(tmp_path, corpus):
    """A rank SIGKILLed (as the OOM killer would): one line naming it and the signal, exit 128 + 9. Ctrl-C to
    the launcher: the agent hands SIGINT to the ranks once, they save, one line, exit 130."""
    procs = {}
    for name in ("kill", "ctrl_c"):  # both at once: their start-ups overlap
        procs[name] = subprocess.Popen(_args(tmp_path / name, corpus, "--train.steps=100000",
                                             "--checkpoint.preempt_grace_s=20"),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    runs = []
    try:
        for name, p in procs.items():
            tmp = tmp_path / name
            deadline = time.monotonic() + 120
            while _records(tmp / "run") < 2 and time.monotonic() < deadline and p.poll() is None:
                time.sleep(0.1)
            victim = None
            if name == "kill":
                victim = max(_workers(p.pid))
                os.kill(victim, signal.SIGKILL)
            else:
                p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=90)
            runs.append((p.returncode, out, err, victim, tmp))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    code, out, err, victim, _ = runs[0]
    lines = err.strip().splitlines()
    assert code == 128 + signal.SIGKILL, err[-3000:]  # the killed rank is the cause, not its peer's report
    assert f"shardlm: error: rank 1 (pid {victim}) was killed by SIGKILL (the kernel's OOM killer? see `dmesg`)" \
        in lines, err[-3000:]
    # rank 0 may have seen its peer's socket close before the agent saw the death: then its own line too
    others = [x for x in lines if not x.startswith("shardlm: error: rank 1 ")]
    assert len(others) <= 1 and all(x.startswith("shardlm: error: rank 0: step ") and "waiting for rank 1" in x
                                    for x in others), err[-3000:]
    code, out, err, _, tmp = runs[1]
    saved = sorted(int(d.name.split("-")[1]) for d in (tmp / "run" / "checkpoints").glob("step-*"))
    assert code == 130 and len(saved) == 1, err[-3000:]
    assert err.strip().splitlines() == [f"shardlm: interrupted at step {saved[0]}; last complete checkpoint "
                                        f"step-{saved[0]}"], err[-3000:]


@pytest.mark.parametrize("argv, needle", [
    (["--nproc-per-node", "0"], "--nproc-per-node must be a positive number of ranks per node or `gpu`, got '0'"),
    (["--nproc-per-node", "2", "--nnodes", "2"], "--nnodes above 1 needs --rdzv-endpoint HOST:PORT"),
    (["--nproc-per-node", "2", "--nnodes", "3:2"], "--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got '3:2'"),
    (["--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint", "head"], "--rdzv-endpoint must be HOST:PORT"),
    (["--max-restarts", "2"], "--max-restarts go with --nproc-per-node N"),
])
def test_launch_flags_are_checked_before_any_rank_starts(argv, needle, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert main(["train", "--config", DEBUG, f"--train.output_dir={tmp_path}", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_no_launch_inside_a_launched_rank(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["train", "--config", DEBUG, f"--train.output_dir={tmp_path}", "--nproc-per-node", "2"]) == 2
    assert "--nproc-per-node inside a launched rank" in capsys.readouterr().err


def test_the_exit_code_is_the_root_cause_not_a_peer_report():
    """Rank 1's ConfigError (exit 2) is the cause; rank 0's exit 8 (it saw the collective fail) only a report,
    even when it came first; identical lines once; a rank without a line is named with its signal."""
    f = lambda code, msg, ts=0, pid=1: SimpleNamespace(exitcode=code, message=msg, timestamp=ts, pid=pid)  # noqa
    lines, code = summarize({0: f(8, "shardlm: error: rank 0: step 3: collective failed", ts=5),
                             1: f(2, "shardlm: error: bad", ts=6), 2: f(2, "shardlm: error: bad", ts=6)})
    assert code == 2 and lines == ["shardlm: error: rank 0: step 3: collective failed", "shardlm: error: bad"]
    # the rank that raised first was SIGTERMed by the agent while it exited: the other's code counts
    lines, code = summarize({0: f(-signal.SIGTERM, "shardlm: error: diverged", ts=4),
                             1: f(6, "shardlm: error: diverged", ts=5)})
    assert code == 6 and lines == ["shardlm: error: diverged"]
    lines, code = summarize({3: f(-signal.SIGSEGV, "Signal 11 (SIGSEGV) received by PID 7", pid=7)})
    assert code == 128 + 11 and lines == ["shardlm: error: rank 3 (pid 7) was killed by SIGSEGV"]
    lines, code = summarize({0: f(1, "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")})
    assert code == 1 and "exited with code 1 without a shardlm error line (its traceback is above)" in lines[0]
