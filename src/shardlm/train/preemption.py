"""SIGTERM, and Ctrl-C during the training loop -> checkpoint and stop after the current step."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable


class Preemption:
    """SIGTERM (SLURM, Kubernetes, torchrun) or Ctrl-C (SIGINT) -> finish the step, save, stop, within a
    grace period.

    `requested` is set by the signal; the trainer reduces it over the ranks so that all stop after the
    same step. A stop asked for by SIGTERM ends with exit 0, one asked for by Ctrl-C with 130 (the
    trainer raises `Interrupted`). A SIGTERM that repeats is ignored (launchers send more than one).
    A second Ctrl-C, or a SIGTERM after a Ctrl-C (torchrun turns a second Ctrl-C into a SIGTERM to its
    workers), ends the process at once with 130: the save in flight is a `.step-N.partial` folder,
    which is never taken for a checkpoint. Past `grace_s` the process also ends (SIGTERM: 1, Ctrl-C: 130).

    `status()` is the trainer's `interrupted at step N; last complete checkpoint step-M`, the line
    (rank 0, stderr) a Ctrl-C that ends here leaves.
    """

    def __init__(self, grace_s: float, log: Callable[[str], None], status: Callable[[], str], rank0: bool):
        self.grace_s, self.log, self.status, self.rank0 = grace_s, log, status, rank0
        self.requested = False  # a stop was asked for (SIGTERM, or Ctrl-C in the loop)
        self.interrupted = False  # ... and it was a Ctrl-C
        self._old: dict[signal.Signals, object] = {}
        self._timer: threading.Timer | None = None
        self._install(signal.SIGTERM)

    def catch_ctrl_c(self) -> None:
        """From here (the training loop) Ctrl-C asks for a stop like SIGTERM. Before this and after
        `release_ctrl_c` (setup, the final sample) it raises KeyboardInterrupt: there is no step to finish."""
        self._install(signal.SIGINT)

    def release_ctrl_c(self) -> None:
        self._restore(signal.SIGINT)

    def uninstall(self) -> None:
        for sig in list(self._old):
            self._restore(sig)
        if self._timer is not None:  # the stop went through: no exit from under an in-process caller
            self._timer.cancel()

    def _install(self, sig: signal.Signals) -> None:
        if threading.current_thread() is threading.main_thread() and sig not in self._old:
            self._old[sig] = signal.signal(sig, self._handle)

    def _restore(self, sig: signal.Signals) -> None:
        if sig in self._old:
            signal.signal(sig, self._old.pop(sig))

    def _handle(self, signum, frame) -> None:
        ctrl_c = signum == signal.SIGINT
        if self.requested:
            if ctrl_c or self.interrupted:
                self._end("a second Ctrl-C: the save in progress was dropped", 130)
            return
        self.requested, self.interrupted = True, ctrl_c
        self._timer = threading.Timer(self.grace_s, self._give_up)
        self._timer.daemon = True
        self._timer.start()

    def _give_up(self) -> None:
        if self.interrupted:
            self._end(f"no checkpoint within checkpoint.preempt_grace_s={self.grace_s}s", 130)
            return
        self.log(f"preemption: no checkpoint within checkpoint.preempt_grace_s={self.grace_s}s; exiting, "
                 "the last complete checkpoint stands")
        os._exit(1)

    def _end(self, why: str, code: int) -> None:
        """Exit now with `code` and (rank 0) the status line; written with os.write: this may run inside
        a signal handler that interrupted a print."""
        if self.rank0:
            os.write(2, f"shardlm: {self.status()} ({why})\n".encode())
        os._exit(code)
