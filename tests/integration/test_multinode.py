"""Multi-node on one machine: two torchrun agents (2 ranks each, c10d rendezvous on 127.0.0.1) play two
nodes. `auto` degrees give a 2x2 HSDP mesh whose losses equal a 4-rank single-node FSDP run; a node that
vanishes (its agent and ranks SIGKILLed) ends the other node's ranks with one line naming the step, the
phase and the ranks; restarted, the run resumes and matches an uninterrupted one."""

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


def _agent(port: int, host: bool, args: list[str], log: Path, restarts: int = 0) -> subprocess.Popen:
    """One 'node': a torchrun agent with 2 ranks joining the c10d rendezvous at 127.0.0.1:port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=shardlm-test",
           f"--rdzv-conf=is_host={str(host).lower()},join_timeout=120", f"--max-restarts={restarts}",
           "--monitor-interval=0.5", *args]
    return subprocess.Popen(cmd, stdout=log.open("a"), stderr=subprocess.STDOUT, env=ENV, cwd=ROOT,
                            start_new_session=True)


def _records(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def _kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL an agent and every process under it: the node is gone."""
    pids, todo = [], [p.pid]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(k) for k in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    for pid in pids:
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


def test_two_agents_make_a_2x2_hsdp_mesh_equal_to_4_ranks_on_one_node(tmp_path, corpus):
    steps = 6
    logs = _two_nodes(tmp_path, _train_args(tmp_path, corpus, "hsdp", steps), "hsdp")
    assert "mesh dp_replicate=2 x dp_shard=2 (auto: HSDP 2 x 2 (2 ranks per node, from LOCAL_WORLD_SIZE)" in logs
    one = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                          *_train_args(tmp_path, corpus, "fsdp", steps)],
                         capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert "mesh dp_shard=4 (auto: FSDP over all 4 ranks (one node" in one.stdout
    hsdp, fsdp = _records(tmp_path / "hsdp"), _records(tmp_path / "fsdp")
    assert [r["step"] for r in hsdp] == [r["step"] for r in fsdp] == list(range(1, steps + 1))
    for h, f in zip(hsdp, fsdp):
        assert abs(h["loss"] - f["loss"]) <= 1e-5 * abs(f["loss"]), (h["loss"], f["loss"])
        assert abs(h["grad_norm"] - f["grad_norm"]) <= 1e-5 * abs(f["grad_norm"]), (h, f)
