"""Everything a run takes once around its training, in order, and gives back in reverse.

A run's operations, not its training: the environment preset (before anything reads NCCL or allocator
variables), the launch (topology and mesh dimensions, before the process group: no collective may wait on a
long data preparation), the process group, the watchdog (from here a dead peer or launcher is one line,
never a hang), the preemption handlers (SIGTERM / Ctrl-C: finish the step, save, stop), the device mesh and
its timeouts, the preflight, the folder locks and the writability check. Each step that takes something
pushes its release; `close()` gives everything back, last taken first, also after a start that failed part
way: so a second run in the same process starts as cleanly as the first. The trainer pushes its own
resources (the checkpointer, the model, W&B) onto the same stack, so they go before the process group does.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import shardlm.errors as errors
from shardlm.checkpoint.lineage import current_lineage
from shardlm.checkpoint.manager import remove_partials
from shardlm.config import Config
from shardlm.distributed.check import start_problems
from shardlm.distributed.env import DistEnv, restart_store_warning, shutdown_distributed
from shardlm.distributed.nccl import apply_env
from shardlm.distributed.preflight import preflight
from shardlm.distributed.watchdog import Watchdog, heartbeat_store, install_test_stall, launcher_of
from shardlm.errors import ConfigError, PreflightError, ShardlmError, StorageError, say
from shardlm.parallel.launch import plan_launch
from shardlm.resolve import Resolved
from shardlm.train.preemption import Preemption
from shardlm.train.rundir import RunLock, check_writable


class Session:
    """The run's operations, taken in the order of the methods below and released in reverse by `close()`.

    `log` writes a line on rank 0; `status` is the `interrupted at step N; ...` line a Ctrl-C leaves."""

    def __init__(self, cfg: Config, log: Callable[[str], None], status: Callable[[], str]):
        self.cfg, self.log, self.status = cfg, log, status
        self.stack = ExitStack()
        self.first = os.environ.get("RANK", "0") == "0"  # rank 0, known before the process group starts
        self.env: DistEnv | None = None
        self.watchdog: Watchdog | None = None
        self.preemption: Preemption | None = None
        self.locks: list[RunLock] = []
        # NCCL and torch read these when the process group (and the CUDA allocator) starts: first thing.
        self.env_report = apply_env(cfg.env.preset, cfg.env.set_, Path(cfg.train.output_dir))

    def launch(self, run: Resolved, state_bytes: Callable[[str], int]) -> None:
        """What in the environment would break the start, then the launcher's topology and the mesh degrees
        (`parallel.dp_* = auto` may weigh the model's state against the device): before any data is prepared
        or any peer is waited for (parallel/launch.py, the one launch path)."""
        self.run = run
        if problems := start_problems(os.environ, cuda=run.device_type == "cuda"):
            raise ConfigError(str(problems[0]))
        self.plan = plan_launch(self.cfg.parallel, self.cfg.train.device, state_bytes)
        self.topo, self.dims, self.dims_reason = self.plan.topology, self.plan.dims, self.plan.reason

    def join(self) -> DistEnv:
        """The process group, then the watchdog (a dead or stalled peer, or a launcher that is gone, ends this
        rank with one line, exit 8) and the preemption handlers; the environment's lines on rank 0."""
        p = self.cfg.parallel
        self.env = env = self.plan.start()
        self.stack.callback(self._teardown)  # the process group, then the watchdog: released last
        folder = self.run.checkpoint_dir
        self.watchdog = wd = Watchdog(env.rank, env.world_size, heartbeat_store(), p.init_timeout_s,
                                      local_world_size=self.topo.ranks_per_node,
                                      backend="nccl" if env.device.type == "cuda" else "gloo",
                                      tail=lambda: stands(folder), launcher_pid=launcher_of()).start()
        install_test_stall(wd, os.environ.get("SHARDLM_TEST_STALL"))
        # From here on a SIGTERM is a request to checkpoint and stop, honoured after the next step
        # (and so is Ctrl-C, during the training loop).
        self.preemption = Preemption(self.cfg.checkpoint.preempt_grace_s, self.log, self.status, env.rank == 0)
        self.stack.callback(self.preemption.uninstall)
        return env

    def startup_lines(self, warnings: list[str]) -> None:
        """The environment preset's lines (rank 0), its warnings and the caller's on stderr."""
        if self.env is None or self.env.rank != 0:
            return
        env_lines = self.env_report.lines()
        for line in env_lines:
            if ": warning: " not in line:
                self.log(line)
        for warning in [*[line for line in env_lines if ": warning: " in line], *warnings, restart_store_warning()]:
            if warning:
                say(warning)

    def mesh(self):
        """The device mesh with the run's timeouts on its groups, the preflight, the folder locks."""
        assert self.env is not None and self.watchdog is not None
        # The mesh's groups take the backend's default timeout, not init_process_group's: set them.
        self.device_mesh = self.plan.build_mesh(self.env, self.watchdog.pg_timeout_s(self.cfg.parallel.init_timeout_s))
        self.run_preflight()
        self.locks = self.lock_run_folders()
        self.stack.callback(self.release_locks)
        return self.device_mesh

    def on_close(self, fn: Callable[[], Any]) -> None:
        """Release `fn` with the session: before everything taken so far (the process group last)."""
        self.stack.callback(fn)

    def close(self) -> None:
        """Give everything back, last taken first; a second call does nothing."""
        if self.watchdog is not None:
            self.watchdog.enter("shutdown")
        self.stack.close()

    def _teardown(self) -> None:
        shutdown_distributed()
        if self.watchdog is not None:
            self.watchdog.stop()  # after the teardown: one that hangs is still ended by the backstop

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on rank 0 (a setup step only rank 0 does); a shardlm error it raises stops every rank with
        rank 0's line and exit code (the others would otherwise wait in their next collective and report rank 0
        as gone). Every rank must call it at the same point."""
        error, result = [None], None
        if self.env.rank == 0:
            try:
                result = fn()
            except ShardlmError as e:
                error = [(type(e).__name__, str(e))]
        dist.broadcast_object_list(error, src=0)  # our own ranks' objects: nothing untrusted is unpickled
        if error[0] is not None:
            kind, line = error[0]
            cls = getattr(errors, kind, ShardlmError)
            raise (cls if isinstance(cls, type) and issubclass(cls, ShardlmError) else ShardlmError)(line)
        return result

    def run_preflight(self) -> None:
        """parallel.preflight: every rank times a GEMM and an all-reduce per mesh dimension; a slow one is named
        (and with `strict` the run stops, on every rank alike, before anything is written)."""
        p = self.cfg.parallel.preflight
        if not (p is True or p == "strict" or (p == "auto" and self.topo.nodes > 1)) or self.env.world_size == 1:
            return
        self.watchdog.enter("preflight")
        result = preflight(self.device_mesh, self.env.device, local_world_size=self.topo.ranks_per_node)
        for line in result.lines():
            self.log(line)
        if p == "strict" and not result.ok:
            raise PreflightError(result.message() + "; replace the node or set parallel.preflight=true to only warn")

    def lock_run_folders(self) -> list[RunLock]:
        """Rank 0 locks train.output_dir (and checkpoint.dir when it lies elsewhere) before anything is
        written there; every rank gets rank 0's verdict, so all stop together with its line."""
        output_dir, ck_dir = Path(self.cfg.train.output_dir), self.run.checkpoint_dir
        folders = [(output_dir, "train.output_dir")]
        if not ck_dir.resolve().is_relative_to(output_dir.resolve()):
            folders.append((ck_dir, "checkpoint.dir"))

        def lock_all() -> list[RunLock]:
            locks: list[RunLock] = []
            try:
                for folder, what in folders:
                    try:
                        folder.mkdir(parents=True, exist_ok=True)
                    except OSError as e:
                        raise ConfigError(f"{what} {str(folder)!r} cannot be created: {e.strerror}") from None
                    # the lock over the checkpoints may clear a dead run's partial save (which may be what
                    # filled the disk) to make room for itself
                    room = (lambda: remove_partials(ck_dir, self.log)) if folder == folders[-1][0] else None
                    lock = RunLock(folder, self.log, what, make_room=room)
                    lock.acquire()
                    locks.append(lock)
            except ShardlmError:
                for lock in locks:
                    lock.release()
                raise
            return locks

        return self.on_rank0(lock_all) or []  # the other ranks hold no lock

    def release_locks(self) -> None:
        for lock in self.locks:
            lock.release()
        self.locks = []

    def check_writable(self, n_saved: int, n_trained: int) -> None:
        """Every rank can write where it will write, and one checkpoint (`n_saved` parameters, `n_trained` of
        them with AdamW moments) fits, before step 1."""
        env, c = self.env, self.cfg.checkpoint
        need = 4 * n_saved + 8 * n_trained  # fp32 weights + two AdamW moments
        warnings, error = [], None
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if env.rank == 0:  # what a dead run's save left (it may be what filled the disk): before the probe
            remove_partials(self.run.checkpoint_dir, self.log)
        try:
            check_writable(Path(self.cfg.train.output_dir), "train.output_dir", env.rank)
            if c.save_final or c.interval > 0:
                w = check_writable(self.run.checkpoint_dir, "checkpoint.dir" if c.dir else "train.output_dir",
                                   env.rank, need, share=local_world / env.world_size)
                warnings += [w] if w else []
        except (ConfigError, StorageError) as e:
            error = e
        flag = torch.tensor([float(error is not None)])
        dist.all_reduce(flag)
        if error is not None:
            raise error
        if flag.item():
            raise ConfigError("another rank cannot write its output or checkpoint folder (see its error)")
        for w in warnings:
            self.log(w)


def last_checkpoint(folder: Path) -> str:
    """`last complete checkpoint step-M` (the one resume=auto takes), or `no checkpoint saved`."""
    done = current_lineage(folder)
    return f"last complete checkpoint {done[0].name}" if done else "no checkpoint saved"


def stands(folder: Path) -> str:
    """What a failed run leaves to resume from: `the last complete checkpoint step-M stands (...)`, or that
    none was saved."""
    done = current_lineage(folder)
    if done:
        return f"the last complete checkpoint {done[0].name} stands (resume with checkpoint.resume=auto)"
    return "no checkpoint was saved yet: a restart begins at step 0"
