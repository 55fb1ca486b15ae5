"""Run a function on N gloo ranks (one process each) and collect what rank 0 returns."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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
    """fn(*args) on `world` ranks (torchrun-style env, gloo); returns rank 0's result."""
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "result.pkl")
        try:
            mp.start_processes(_entry, args=(world, _free_port(), fn, args, out), nprocs=world, start_method="spawn")
        except Exception as e:
            errs = [p.read_text() for p in sorted(Path(d).glob("result.pkl.err*"))]
            raise AssertionError(f"a rank failed: {e}\n" + "\n".join(errs)) from None
        return pickle.loads(Path(out).read_bytes())
