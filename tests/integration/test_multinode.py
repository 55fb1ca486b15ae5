"""Multi-node on one machine: two torchrun agents (2 ranks each, c10d rendezvous on 127.0.0.1) play two
nodes. `auto` degrees give a 2x2 HSDP mesh whose losses equal a 4-rank single-node FSDP run; a node that
vanishes (its agent and ranks SIGKILLed) ends the other node's ranks with one line naming the step, the
phase and the ranks; restarted, the run resumes and matches an uninterrupted one. A rank that stalls
inside a collective phase makes the others time out with that phase named."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug.toml")
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
pytestmark = pytest.mark.slow


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_args(tmp: Path, corpus: Path, run: str, steps: int, **extra) -> list[str]:
    o = {"data.path": corpus, "data.seq_len": 64, "data.cache_dir": tmp / "cache", "train.micro_batch_size": 2,
         "train.output_dir": tmp / run, "train.steps": steps, "train.warmup_steps": 3, "metrics.log_every": 1,
         "parallel.dp_shard": "auto", "parallel.dp_replicate": "auto", "train.mixed_precision": "fp32"}
    o.update(extra)
    return ["-m", "shardlm", "train", "--config", DEBUG, *[f"--{k}={v}" for k, v in o.items()]]


def _agent(port: int, host: bool, args: list[str], log: Path, restarts: int = 0,
           env: dict | None = None) -> subprocess.Popen:
    """One 'node': a torchrun agent with 2 ranks joining the c10d rendezvous at 127.0.0.1:port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=shardlm-test",
           f"--rdzv-conf=is_host={str(host).lower()},join_timeout=120", f"--max-restarts={restarts}",
           "--monitor-interval=0.5", *args]
    return subprocess.Popen(cmd, stdout=log.open("a"), stderr=subprocess.STDOUT, env=env or ENV, cwd=ROOT,
                            start_new_session=True)


def _records(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def _kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL an agent and every process under it: the node is gone."""
    for pid in _tree(p.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            _kill_tree(p)
            p.wait(timeout=30)


def _two_nodes(tmp: Path, args: list[str], name: str, timeout: int = 300) -> str:
    port = _port()
    a = _agent(port, True, args, tmp / f"{name}.0.log")
    b = _agent(port, False, args, tmp / f"{name}.1.log")
    try:
        codes = a.wait(timeout=timeout), b.wait(timeout=timeout)
    finally:
        _stop(a, b)
    logs = "".join((tmp / f"{name}.{i}.log").read_text() for i in (0, 1))
    assert codes == (0, 0), logs[-4000:]
    return logs


# The uninterrupted two-node run: the HSDP run compared with one node, and the reference of the node-vanish test.
STEPS, VANISH = 10, {"checkpoint.interval": 4, "parallel.step_timeout_s": 20}


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory, corpus) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("hsdp")
    return tmp, _two_nodes(tmp, _train_args(tmp, corpus, "hsdp", STEPS, **VANISH), "hsdp")


def test_two_agents_make_a_2x2_hsdp_mesh_equal_to_4_ranks_on_one_node(two_node_run, corpus):
    (tmp_path, logs), steps = two_node_run, STEPS
    assert "mesh dp_replicate=2 x dp_shard=2 (auto: HSDP 2 x 2 (2 ranks per node, from LOCAL_WORLD_SIZE)" in logs
    one = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                          *_train_args(tmp_path, corpus, "fsdp", steps, **VANISH)],
                         capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert "mesh dp_shard=4 (auto: FSDP over all 4 ranks (one node" in one.stdout
    hsdp, fsdp = _records(tmp_path / "hsdp"), _records(tmp_path / "fsdp")
    assert [r["step"] for r in hsdp] == [r["step"] for r in fsdp] == list(range(1, steps + 1))
    for h, f in zip(hsdp, fsdp):
        assert abs(h["loss"] - f["loss"]) <= 1e-5 * abs(f["loss"]), (h["loss"], f["loss"])
        assert abs(h["grad_norm"] - f["grad_norm"]) <= 1e-5 * abs(f["grad_norm"]), (h, f)


def test_a_stalled_rank_makes_the_others_time_out_naming_the_phase(tmp_path, corpus):
    """Rank 1 hangs on its way into step 3's backward (a test hook sleeps): rank 0 times out after
    parallel.step_timeout_s and exits 8 with one line naming the step, the phase and rank 1."""
    env = {**ENV, "SHARDLM_TEST_STALL": "1:3:backward reduce-scatter:120"}
    t0 = time.monotonic()
    # preempt_grace_s: rank 1, asleep, gets torchrun's SIGTERM once rank 0 has failed; it then ends after
    # this grace (the default 25 s is time this test would only wait)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        *_train_args(tmp_path, corpus, "stall", 6, **{"parallel.step_timeout_s": 4,
                                                                      "parallel.dp_replicate": 1,
                                                                      "checkpoint.preempt_grace_s": 1})],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=200)
    took = time.monotonic() - t0
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    lines = [x for x in out.splitlines() if x.startswith("shardlm: error: rank 0:")]
    assert len(lines) == 1, out[-4000:]
    line = lines[0]
    assert "step 3: collective failed in backward reduce-scatter" in line, line
    assert "waiting for rank 1 (alive, still in 'forward all-gather" in line, line  # it never got to backward
    # no checkpoint was saved before step 3 (checkpoint.interval=0): the line does not claim one stands
    assert "Timed out waiting 4000ms" in line and line.endswith("no checkpoint was saved yet: a restart begins at "
                                                                 "step 0"), line
    assert took < 100, took  # not the 120 s the rank sleeps, not gloo's 30 min default


def test_a_node_that_vanishes_ends_the_others_and_a_restart_resumes(tmp_path, corpus, two_node_run):
    """Node 1 (its agent and both its ranks) is SIGKILLed after step 4's checkpoint: node 0's ranks exit
    within step_timeout_s + 30 s with one line each naming the step, the phase and node 1's ranks; node 0's
    agent (--max-restarts=1) restarts its ranks, a new node 1 joins, and the run resumes from the
    checkpoint and ends with the losses of an uninterrupted run (`two_node_run`'s, the same config)."""
    steps, extra = STEPS, VANISH
    args = _train_args(tmp_path, corpus, "faulty", steps, **extra)
    # Rank 0 pauses in step 6 so that the kill lands mid-run, after step-4 is on disk.
    env = {**ENV, "SHARDLM_TEST_STALL": "0:6:data:6"}
    port, run = _port(), tmp_path / "faulty"
    logs = [tmp_path / "faulty.0.log", tmp_path / "faulty.1.log"]
    cmd0 = _agent(port, True, args, logs[0], restarts=1, env=env)
    cmd1 = _agent(port, False, args, logs[1])
    procs = [cmd0, cmd1]
    try:
        deadline = time.monotonic() + 200
        while not ((run / "checkpoints" / "step-4").is_dir() and len(_records(run)) >= 5):
            assert time.monotonic() < deadline and cmd0.poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.1)
        victims = _tree(cmd1.pid)
        assert len(victims) >= 3, victims  # the agent and its two ranks
        t0 = time.monotonic()
        _kill_tree(cmd1)
        cmd1.wait(timeout=30)
        while len(_error_lines(logs[0])) < 2:
            assert time.monotonic() - t0 < 20 + 30, logs[0].read_text()[-4000:]
            time.sleep(0.2)
        assert not [pid for pid in victims if Path(f"/proc/{pid}").exists() and _alive(pid)], victims
        for line in _error_lines(logs[0]):
            assert "step 6: collective failed" in line or "step 7: collective failed" in line, line
            assert "node 1 (ranks 2-3)" in line or "rank" in line.split("waiting for", 1)[1], line
        cmd1 = _agent(port, False, args, logs[1])  # the node comes back
        procs.append(cmd1)
        assert cmd0.wait(timeout=300) == 0, logs[0].read_text()[-4000:]
        assert cmd1.wait(timeout=60) == 0, logs[1].read_text()[-4000:]
    finally:
        _stop(*procs)
    log0 = logs[0].read_text()
    assert "checkpoint: resumed from" in log0 and "step-4" in log0, log0[-3000:]
    recs, ref = _records(run), _records(two_node_run[0] / "hsdp")
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    for a, b in zip(recs, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"]), (a, b)


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(k) for k in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return pids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _error_lines(log: Path) -> list[str]:
    return [x for x in log.read_text().splitlines() if x.startswith("shardlm: error: rank")]
