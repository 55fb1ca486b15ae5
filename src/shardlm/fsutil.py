"""Process liveness for the locks shardlm keeps in folders (run folders, the token-store cache, prepare's
OUT, HF exports): a holder is alive when its pid exists and, where its start time was recorded, that pid
still has that start time (a pid the kernel reused for another process is a dead holder)."""

from __future__ import annotations

import os
from pathlib import Path


def proc_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (Linux: /proc/PID/stat field 22), to tell a live holder from a reused
    pid; None where it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int, start: str | None = None) -> bool:
    """Whether `pid` (on this host) is alive, and, given its recorded `start`, still the same process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return start is None or proc_start(pid) in (None, start)
