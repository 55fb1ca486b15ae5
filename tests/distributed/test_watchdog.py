"""The watchdog: a stalled or dead peer ends every surviving rank with one line naming the step, the
collective phase and the rank waited for; a real bug keeps its traceback.

Two 2-rank gloo runs (a stalled peer, a SIGKILLed one) through `fully_shard` and the default
`on_failure` (the line on stderr and in torchrun's error file, exit 8); the rest in-process."""

from __future__ import annotations

import json
import os
import pickle
import signal
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from helpers.launch import run_ranks

from shardlm.distributed.watchdog import Beat, Watchdog, is_comm_failure, short_message, waited_for
from shardlm.errors import CommError

# -- the pure parts ----------------------------------------------------------------------------------


def _beat(beat: int, step: int = 3, progress: int = 10, phase: str = "forward all-gather (block 0)",
          wall: float = 100.0, failed: bool = False) -> Beat:
    return Beat(beat, step, progress, wall, phase, failed)


def test_waited_for_names_dead_then_behind_ranks():
    first = {0: _beat(5), 1: _beat(5), 2: _beat(5), 3: _beat(5)}
    # rank 3's beat did not move: dead, whatever the live ranks' progress says
    second = {0: _beat(8), 1: _beat(8, progress=9), 2: _beat(8), 3: _beat(5, wall=96.0)}
    assert waited_for(first, second, me=0, now=100.0) == "rank 3 (no heartbeat for 4 s: process gone or frozen)"
    # nobody dead: rank 1 is behind the others (in its phase, at the step it runs)
    second[3] = _beat(8)
    second[1] = _beat(8, progress=9, phase="backward reduce-scatter (block 0)")
    assert waited_for(first, second, me=0, now=100.0) == \
        "rank 1 (alive, still in 'backward reduce-scatter (block 0)' at step 4)"
    # a rank that never published is dead too; a rank that gave up itself is not the one waited for
    assert waited_for(first, {**second, 2: None}, me=0, now=100.0).startswith("rank 2 (no heartbeat at all")
    gave_up = {**second, 3: _beat(5, failed=True)}
    assert waited_for(first, gave_up, me=0, now=100.0).startswith("rank 1 (alive")


def test_waited_for_unknown_and_whole_nodes():
    same = {r: _beat(5) for r in range(4)}
    later = {r: _beat(9) for r in range(4)}
    assert waited_for(same, later, me=1, now=100.0) == "unknown (every rank is alive and at the same point)"
    assert waited_for(None, later, me=1, now=100.0).startswith("unknown (the heartbeat store")
    # ranks 2 and 3 are all of node 1 (2 ranks per node): the node is named
    later[2], later[3] = _beat(5, wall=90.0), _beat(5, wall=91.0)
    assert waited_for(same, later, me=0, now=100.0, local_world_size=2) == \
        "node 1 (ranks 2-3) (no heartbeat for 10 s: host or agent gone, or frozen)"


def test_failure_classification_and_message():
    timeout = RuntimeError("[/x/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                           "5000ms for recv operation to complete")
    closed = RuntimeError("[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6362. "
                          "This is typically caused by a remote worker crashing. GLHF!")
    assert is_comm_failure(timeout) and is_comm_failure(closed)
    assert is_comm_failure(torch.distributed.DistBackendError("NCCL error: remote process exited"))
    assert not is_comm_failure(RuntimeError("shape mismatch")) and not is_comm_failure(ValueError("x"))
    assert short_message(timeout) == "Timed out waiting 5000ms for recv operation to complete"
    assert short_message(closed) == "Connection closed by peer [127.0.0.1]:6362"


# -- one rank: guard and backstop ---------------------------------------------------------------------


def test_guard_passes_bugs_through_and_reports_collective_failures():
    lines: list[str] = []
    wd = Watchdog(0, 1, None, 60.0, on_failure=lines.append)
    with pytest.raises(ValueError, match="a bug"):
        with wd.guard("optimizer"):
            raise ValueError("a bug")
    assert lines == []
    wd.step = 6
    with pytest.raises(CommError) as e:
        with wd.guard("grad-norm all-reduce"):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:1234")
    assert lines == [str(e.value)]
    fresh: list[str] = []
    wd = Watchdog(0, 1, None, 60.0, on_failure=fresh.append)
    with pytest.raises(CommError):  # nested guards report once
        with wd.guard(), wd.guard():
            raise torch.distributed.DistNetworkError("Connection reset by peer")
    assert len(fresh) == 1
    assert lines[0].startswith("shardlm: error: rank 0: step 7: collective failed in grad-norm all-reduce after ")
    assert lines[0].endswith(": Connection closed by peer [10.0.0.2]:1234; the last complete checkpoint stands "
                             "(resume with checkpoint.resume=auto)")


def test_backstop_fires_without_progress_and_not_while_progressing():
    fired: list[str] = []
    wd = Watchdog(0, 1, None, 0.3, on_failure=fired.append, heartbeat_s=0.05, grace_s=0.2).start()
    try:
        end = time.monotonic() + 1.2
        while time.monotonic() < end:  # progress every 0.1 s: never more than timeout + grace idle
            wd.enter("data")
            time.sleep(0.1)
        assert fired == []
        wd.step = 2
        wd.enter("optimizer")
        time.sleep(1.2)  # no progress: the thread reports after 0.5 s
        assert len(fired) == 1, fired
        assert fired[0].startswith("shardlm: error: rank 0: step 3: no progress for 0."), fired
        assert " s in optimizer (timeout 0.3 s + 0.2 s grace), waiting for nobody (1 rank); " in fired[0]
    finally:
        wd.stop()


def test_the_thread_lives_when_sys_stderr_has_no_file_number(capsys):
    """capsys puts a StringIO-like sys.stderr in place (a notebook does too): faulthandler's exit timer, re-armed at
    every heartbeat, used to take sys.stderr and kill the watchdog thread with io.UnsupportedOperation."""
    wd = Watchdog(0, 1, None, 30.0, on_failure=lambda line: None, heartbeat_s=0.05, grace_s=1.0).start()
    try:
        time.sleep(0.4)  # several heartbeats
        assert wd._thread is not None and wd._thread.is_alive()
    finally:
        wd.stop()


def test_one_watchdog_per_process_and_none_left_at_exit():
    # A second Trainer in the process stops the first one's watchdog (its backstop would otherwise end
    # the process once that training is idle for timeout + grace); atexit stops the last one, so that no
    # daemon thread is inside the store's C++ call when the interpreter finalizes (an abort after success).
    from shardlm.distributed import watchdog as W

    fired: list[str] = []
    first = Watchdog(0, 1, None, 0.2, on_failure=fired.append, heartbeat_s=0.05, grace_s=0.1).start()
    second = Watchdog(0, 1, None, 30, on_failure=fired.append, heartbeat_s=0.05).start()
    try:
        assert first._thread is None and set(W._LIVE) == {second}
        time.sleep(0.6)  # the first's backstop would have fired after 0.3 s
        assert fired == []
        thread = second._thread
        W._stop_all()
        assert thread is not None and not thread.is_alive() and not W._LIVE
    finally:
        second.stop()


# -- two ranks under fully_shard ----------------------------------------------------------------------


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(2)])
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _failing_step(out: str, failure: str) -> None:
    """Step 1 trains; in step 2 rank 1 stalls (or dies) at the start of block 0's backward. Rank 0
    reports through the default on_failure (stderr, error file, os._exit(8))."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from shardlm._torch_compat import set_pg_timeout
    from shardlm.distributed.watchdog import heartbeat_store, set_timeouts
    from shardlm.parallel.fsdp import apply_fsdp, mp_policy

    warnings.filterwarnings("ignore", message="Full backward hook")  # the test's stall hook
    rank = int(os.environ["RANK"])
    start = time.time()
    os.environ["TORCHELASTIC_ERROR_FILE"] = f"{out}/error{rank}.json"
    os.environ["TORCH_FR_BUFFER_SIZE"] = "64"  # gloo records into the flight recorder too (torch 2.13)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like the trainer's preemption handler: no early death
    dist.init_process_group("gloo")
    results: dict = {}
    if failure == "stall":
        # set_pg_timeout on a group of its own (a timed-out gloo group is broken for good)
        side = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))  # 20 s: if the change did not take
        set_pg_timeout(side, 1.0)
        if rank == 0:
            t0 = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1), group=side)
            except RuntimeError as e:
                results.update(elapsed=time.monotonic() - t0, comm=is_comm_failure(e), message=str(e))
        else:
            time.sleep(2.5)
        dist.barrier()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = apply_fsdp(_Tiny(), mesh, mp_policy("fp32", "fp32"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wd = Watchdog(rank, 2, heartbeat_store(), 60.0, heartbeat_s=0.5, grace_s=10.0, dump_dir=Path(out) / "fr").start()
    phases: list[str] = []
    record = wd.enter
    wd.enter = lambda p: (phases.append(p), record(p))  # type: ignore[method-assign]
    wd.attach(model)
    x = torch.randn(4, 16)

    def step() -> None:
        with wd.guard("forward"):
            model(x).sum().backward()
        with wd.guard("optimizer"):
            opt.step()
            opt.zero_grad()
        wd.step += 1

    step()
    results["phases"] = phases[:]
    Path(f"{out}/results{rank}.json").write_text(json.dumps(results))
    set_timeouts(mesh, 3.0)
    wd.set_timeout(3.0)
    if rank == 1:
        def stall(_module, _grad):
            if failure == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(5.0)

        model.layers[0].register_full_backward_pre_hook(stall)
    Path(f"{out}/t{rank}").write_text(json.dumps([start, time.time()]))
    step()
    raise AssertionError("step 2 should not have finished")


def _run(tmp_path: Path, failure: str) -> tuple[str, float]:
    t0 = time.time()
    with pytest.raises(AssertionError, match="exit code 8|signal SIGKILL"):
        run_ranks(2, _failing_step, str(tmp_path), failure)
    line = json.loads((tmp_path / "error0.json").read_text())["message"]
    return line, time.time() - t0


@pytest.mark.slow
def test_stalled_peer(tmp_path):
    line, _ = _run(tmp_path, "stall")
    results = json.loads((tmp_path / "results0.json").read_text())
    # set_pg_timeout took: the stalled all-reduce raised after ~1 s (not gloo's 30 min), a comm failure
    assert 0.9 < results["elapsed"] < 2.0 and results["comm"], results
    assert "Timed out waiting 1000ms" in results["message"]
    # attach(): each FSDP unit's forward, then the backward in reverse order
    assert results["phases"] == ["forward", "forward all-gather (embeddings/head)", "forward all-gather (block 0)",
                                 "forward all-gather (block 1)", "backward reduce-scatter (embeddings/head)",
                                 "backward reduce-scatter (block 1)", "backward reduce-scatter (block 0)",
                                 "optimizer"]
    # rank 0 waited 3 s in block 0's reduce-scatter for rank 1, alive but still at the start of block 0
    assert line.startswith("shardlm: error: rank 0: step 2: collective failed in backward reduce-scatter "
                           "(block 0) after 3."), line
    assert "waiting for rank 1 (alive, still in 'backward reduce-scatter (block 1)' at step 2): Timed out" in line
    # the flight recorder's dump is named just before what stands (the line ends with how to go on) and holds
    # the collectives (torch 2.13 records gloo's collectives in its generic recorder, read by _dump_fr_trace)
    if hasattr(torch._C._distributed_c10d, "_dump_fr_trace"):
        fr = tmp_path / "fr" / "rank_0"
        assert f"; flight recorder: {fr}; " in line and line.endswith("(resume with checkpoint.resume=auto)"), line
        trace = pickle.loads(fr.read_bytes())  # our own file, written by this test
        assert trace["entries"] and all(e["profiling_name"].startswith("gloo:") for e in trace["entries"])
    # rank 1 then finds rank 0 gone and ends as well, with its own line
    line1 = json.loads((tmp_path / "error1.json").read_text())["message"]
    assert line1.startswith("shardlm: error: rank 1: step 2: collective failed in backward reduce-scatter"), line1
    started = json.loads((tmp_path / "t0").read_text())[1]
    assert os.path.getmtime(tmp_path / "error0.json") - started < 3.0 + 4.0


@pytest.mark.slow
def test_dead_peer(tmp_path):
    line, _ = _run(tmp_path, "kill")
    assert line.startswith("shardlm: error: rank 0: step 2: collective failed in backward reduce-scatter "
                           "(block 0) after 0."), line
    assert "waiting for rank 1 (no heartbeat for " in line and "process gone or frozen): " in line
    assert "Connection reset by peer" in line or "Connection closed by peer" in line
    started = json.loads((tmp_path / "t0").read_text())[1]
    assert os.path.getmtime(tmp_path / "error0.json") - started < 4.0


def _wandb_missing_on_rank0(tmp: str, corpus: str) -> None:
    """metrics.wandb=true where only rank 0 lacks wandb: its setup step fails there alone."""
    import sys

    import torch.distributed as dist

    from shardlm.config import load_config
    from shardlm.train.trainer import Trainer

    rank = int(os.environ["RANK"])
    if rank == 0:
        sys.modules["wandb"] = None  # an ImportError on rank 0 only
    cfg = load_config(None, ["--model.preset=debug", f"--data.path={corpus}", "--data.seq_len=64",
                             f"--data.cache_dir={tmp}/cache", f"--train.output_dir={tmp}/run", "--train.steps=2",
                             "--train.micro_batch_size=2", "--metrics.wandb=true", "--metrics.progress_bar=false"])
    try:
        Trainer(cfg)
        outcome = "started"
    except Exception as e:  # noqa: BLE001 - the test reports what each rank raised
        outcome = f"{type(e).__name__}: {e}"
    Path(tmp, f"rank{rank}.txt").write_text(outcome)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_setup_step_only_rank_0_does_stops_every_rank_with_its_line(tmp_path, corpus):
    """W&B (rank 0 only) fails: rank 1 used to wait in its next collective and report rank 0 as gone
    ('collective failed ... waiting for rank 0'); now every rank raises rank 0's own line."""
    run_ranks(2, _wandb_missing_on_rank0, str(tmp_path), str(corpus))
    want = "ConfigError: metrics.wandb=true needs wandb (not installed): pip install 'shardlm[wandb]'"
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == [want, want]
