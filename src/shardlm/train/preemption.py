"""SIGTERM -> checkpoint and stop after the current step."""

from __future__ import annotations

import os
import signal
import threading


class Preemption:
    """SIGTERM (SLURM, Kubernetes, torchrun) -> finish the step, save, exit 0, within a grace period."""

    def __init__(self, grace_s: float, log):
        self.grace_s, self.log, self.requested = grace_s, log, False
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handle)

    def uninstall(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            return
        self.requested = True
        timer = threading.Timer(self.grace_s, self._give_up)
        timer.daemon = True
        timer.start()

    def _give_up(self) -> None:
        self.log(f"preemption: no checkpoint within checkpoint.preempt_grace_s={self.grace_s}s; exiting, "
                 "the last complete checkpoint stands")
        os._exit(1)
