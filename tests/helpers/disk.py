"""A small tmpfs: a real full disk (ENOSPC) for the disk-full tests (the `small_disk` fixture mounts one)."""

from __future__ import annotations

import subprocess
from pathlib import Path


class SmallDisk:
    """A tmpfs of a few MB at `path` (a real full disk: ENOSPC); `resize(mb)` grows or shrinks it in place."""

    def __init__(self, path: Path):
        self.path = path

    def _mount(self, *opts: str) -> None:
        subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(opts), "tmpfs", str(self.path)], check=True,
                       capture_output=True)

    def resize(self, mb: int) -> None:
        self._mount("remount", f"size={mb}m")
