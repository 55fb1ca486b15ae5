"""`shardlm train --nproc-per-node N`: start the ranks through torch's elastic launch API and keep one line.

torchrun ends every failure with its own `ChildFailedError` block and a traceback (~40 lines) under the
ranks' line. This launcher runs the same agent (`torch.distributed.launcher.api.elastic_launch`, the one
torchrun uses: c10d rendezvous, `--max-restarts`, the same worker environment), tells the ranks to leave their
error line to it (`LAUNCHED`: they still write it to torchelastic's error file), and on a failure prints each
failed rank's line once (identical lines once) and returns the root cause's exit code: the earliest failure,
a peer's exit 8 (it only reports a failure it saw) and the agent's SIGTERM to the ranks left counting after
any other.

`torchrun -m shardlm train` keeps working as before; the ranks behave the same under both.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from typing import Iterator

from shardlm.errors import CommError, ConfigError, Interrupted, say

LAUNCHED = "SHARDLM_LAUNCHER"  # set in the ranks' environment: "the launcher prints your error line"


@dataclass
class LaunchOptions:
    nproc_per_node: int
    min_nodes: int = 1
    max_nodes: int = 1
    rdzv_endpoint: str = ""  # HOST:PORT of the c10d rendezvous; "" with one node: a local one on a free port
    rdzv_id: str = ""
    max_restarts: int = 0
    monitor_interval: float = 0.5

    @property
    def standalone(self) -> bool:
        return self.max_nodes == 1 and not self.rdzv_endpoint


def parse_nproc(value: str, cuda_count: int | None = None) -> int:
    """`N`, or `gpu` (this node's CUDA devices)."""
    if value == "gpu":
        if cuda_count is None:
            import torch

            cuda_count = torch.cuda.device_count()
        if cuda_count < 1:
            raise ConfigError("--nproc-per-node gpu: no CUDA GPU is visible here; pass a number of ranks")
        return cuda_count
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"--nproc-per-node must be a positive number of ranks per node or `gpu`, got {value!r}")
    return n


def parse_nnodes(value: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` (elastic)."""
    lo, _, hi = value.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        a = b = 0
    if not 1 <= a <= b:
        raise ConfigError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {value!r}")
    return a, b


def options(nproc: str, nnodes: str = "1", rdzv_endpoint: str = "", rdzv_id: str = "",
            max_restarts: int = 0) -> LaunchOptions:
    lo, hi = parse_nnodes(nnodes)
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
    if hi > 1 and not rdzv_endpoint:
        raise ConfigError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (the first node's address, the same "
                          "on every node)")
    if rdzv_endpoint:
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--rdzv-endpoint must be HOST:PORT, got {rdzv_endpoint!r}")
    if hi > 1 and not rdzv_id:
        rdzv_id = os.environ.get("SLURM_JOB_ID", "")
        if not rdzv_id:
            raise ConfigError("--nnodes above 1 needs --rdzv-id ID, the same on every node (e.g. the job id)")
    return LaunchOptions(parse_nproc(nproc), lo, hi, rdzv_endpoint, rdzv_id, max_restarts)


def _rank_of_cause(code: int) -> int:
    """0: a cause (a shardlm error, a crash, the OOM killer's SIGKILL); 1: a peer's report of a failure it saw
    (exit 8); 2: the agent's own SIGTERM/SIGINT to the ranks left once one failed."""
    if code == CommError.exit_code:
        return 1
    if code in (-signal.SIGTERM, -signal.SIGINT):
        return 2
    return 0


def summarize(failures: dict[int, object]) -> tuple[list[str], int]:
    """(lines to print, exit code) of torchelastic's failures ({global rank: ProcessFailure}).

    A rank that wrote its line (shardlm's error file) is that line; one that died without one (a signal: the
    OOM killer, a segfault; a Python traceback, printed above) is a line saying so. Identical lines once, in
    rank order. The exit code: the earliest cause's; a peer's report (exit 8) and a rank the agent stopped
    (SIGTERM) only when there is no cause."""
    lines: list[str] = []
    order = []
    for rank in sorted(failures):
        f = failures[rank]
        code, message = int(getattr(f, "exitcode", 1)), str(getattr(f, "message", "") or "")
        if message.startswith("shardlm: "):
            line = message
        elif code < 0:
            sig = -code
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            hint = " (the kernel's OOM killer? see `dmesg`)" if sig == signal.SIGKILL else ""
            line = f"shardlm: error: rank {rank} (pid {getattr(f, 'pid', '?')}) was killed by {name}{hint}"
        else:
            line = (f"shardlm: error: rank {rank} (pid {getattr(f, 'pid', '?')}) exited with code {code} without "
                    "a shardlm error line (its traceback is above)")
        if line not in lines:
            lines.append(line)
        order.append((_rank_of_cause(code), int(getattr(f, "timestamp", 0) or 0), rank, code))
    if not order:
        return lines, 1
    code = sorted(order)[0][3]
    return lines, code if code > 0 else 128 + (-code if code < 0 else 1)


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """The agent's own INFO/WARNING/ERROR logging (its failure table, its rendezvous chatter) off, unless
    LOGLEVEL asks for it (torchrun's variable)."""
    if os.environ.get("LOGLEVEL"):
        yield
        return
    # torch's elastic modules each set their logger's own level (LOGLEVEL, default WARNING): set each one's
    names = [n for n in logging.root.manager.loggerDict if n.startswith(("torch.distributed.elastic",
                                                                         "torch.distributed.launcher"))]
    loggers = [logging.getLogger(n) for n in ["torch.distributed.elastic", *names]]
    before = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(loggers, before):
            log.setLevel(level)


def launch(opts: LaunchOptions, worker_argv: list[str]) -> int:
    """Run `python -m shardlm <worker_argv>` on `opts.nproc_per_node` ranks of this node (and the other nodes'
    ranks, through the rendezvous); returns the exit code to end with."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if "LOCAL_RANK" in os.environ:
        raise ConfigError("--nproc-per-node inside a launched rank (torchrun already started this process): "
                          "drop --nproc-per-node, or run `shardlm train --nproc-per-node N` without torchrun")
    if opts.max_restarts == 0:  # with restarts each attempt's ranks print their own lines, as under torchrun
        os.environ[LAUNCHED] = "1"
    else:  # the shared rendezvous store hands restarted ranks the previous round's addresses (pytorch#135712)
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # torchrun's default for more than one rank per node; theirs to override
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // opts.nproc_per_node)))
    config = LaunchConfig(min_nodes=opts.min_nodes, max_nodes=opts.max_nodes, nproc_per_node=opts.nproc_per_node,
                          run_id=opts.rdzv_id or str(uuid.uuid4()), rdzv_backend="c10d",
                          rdzv_endpoint=opts.rdzv_endpoint or "localhost:0",
                          rdzv_configs={} if opts.standalone else {"join_timeout": 900},
                          max_restarts=opts.max_restarts, monitor_interval=opts.monitor_interval,
                          start_method="spawn")
    try:
        with _quiet_agent():
            elastic_launch(config, sys.executable)("-m", "shardlm", *worker_argv)
    except ChildFailedError as e:
        lines, code = summarize(e.failures)
        if opts.max_restarts:
            lines = [f"shardlm: error: the ranks failed again after --max-restarts={opts.max_restarts} restarts (each "
                     "attempt's lines are above); the last complete checkpoint stands"]
        for line in lines:
            say(line)
        return code
    except SignalException as e:  # SIGTERM/SIGINT to the launcher: handed to the ranks, which saved and said so
        sig = getattr(e, "sigval", signal.SIGTERM)
        if sig == signal.SIGINT:
            return Interrupted.exit_code
        return 128 + int(sig)
    return 0


__all__ = ["LAUNCHED", "LaunchOptions", "launch", "options", "summarize"]
