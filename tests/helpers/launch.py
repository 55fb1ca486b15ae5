"""Run a function on N gloo ranks (one process each) and collect what rank 0 returns.

The ranks are forked from a forkserver that imports torch and shardlm once per test session, so a rank
starts in a fraction of a second instead of importing torch again (a few seconds of CPU per rank, dozens
of ranks in the suite, on two cores). The forkserver is a fresh interpreter that only imports: no process
group, no OpenMP pool, nothing a fork could copy half-way. Each rank then takes the caller's current
environment, as a spawned process would. (An edit to shardlm made during a pytest session reaches the
ranks with the next session.)"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

# What every rank imports anyway; the forkserver imports these once (an ImportError is ignored there).
PRELOAD = ["torch", "torch.distributed.checkpoint", "shardlm.train.trainer", "shardlm.plan", "helpers.launch"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, env: dict, fn: Callable, args: tuple, out: str) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's environment now, not the forkserver's from when it started
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A native abort (SIGABRT, SIGSEGV) leaves no Python traceback: have every thread's stack written
    # where run_ranks reads the ranks' errors, so a failure names where it happened.
    fault = open(f"{out}.err{rank}.fault", "w")
    faulthandler.enable(file=fault, all_threads=True)
    import torch

    torch.set_num_threads(1)
    try:
        result = fn(*args)
    except BaseException:
        Path(f"{out}.err{rank}").write_text(traceback.format_exc())
        raise
    finally:
        from shardlm.distributed.env import shutdown_distributed

        shutdown_distributed()  # destroy_process_group alone can leave gloo threads to abort at exit
    if rank == 0:
        # Our own file, written and read by this test run: pickle is safe here.
        Path(out).write_bytes(pickle.dumps(result))


def run_ranks(world: int, fn: Callable, *args: Any) -> Any:
    """fn(*args) on `world` ranks (torchrun-style env, gloo); returns rank 0's result.

    A rank that fails makes the test fail with every rank's error: its Python traceback, or for a native crash
    (SIGABRT, SIGSEGV: no Python exception) the stacks faulthandler wrote. Nothing is run again: a native crash
    in a rank is a bug to find, not noise (see test_optim_state_fsdp's note on the heap corruption once seen)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)  # used when the server starts
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "result.pkl")
        try:
            mp.start_processes(_entry, args=(world, _free_port(), dict(os.environ), fn, args, out),
                               nprocs=world, start_method="forkserver")
        except Exception as e:
            errs = [f"{p.name}:\n{p.read_text()}" for p in sorted(Path(d).glob("result.pkl.err*")) if p.stat().st_size]
            raise AssertionError(f"a rank failed: {e}\n" + "\n".join(errs)) from None
        return pickle.loads(Path(out).read_bytes())
