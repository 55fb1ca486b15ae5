"""This process's threads by name (Linux /proc), for tests that check what a teardown leaves running."""

from __future__ import annotations

import os
from pathlib import Path


def thread_names() -> list[str]:
    """The names of this process's live threads, sorted; a thread that ends while they are read is left out
    (it is gone: listing /proc/self/task and reading each comm file is not one atomic step)."""
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{t}/comm").read_text().strip())
        except FileNotFoundError:
            continue
    return sorted(names)
