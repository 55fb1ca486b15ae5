"""Shared fixtures: a small corpus made from local files, so no test downloads anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardlm.data.sources import builtin_files


def write_corpus(path: Path, n_bytes: int = 200_000) -> Path:
    """A deterministic text file of ~n_bytes taken from the standard library's top-level modules."""
    out, size = [], 0
    for f in builtin_files(max_depth=0):
        text = f.read_text(encoding="utf-8", errors="ignore")
        out.append(text)
        size += len(text)
        if size >= n_bytes:
            break
    path.write_text("".join(out)[:n_bytes], encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


class SmallDisk:
    """A tmpfs of a few MB at `path` (a real full disk: ENOSPC); `resize(mb)` grows or shrinks it in place."""

    def __init__(self, path: Path):
        self.path = path

    def _mount(self, *opts: str) -> None:
        import subprocess

        subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(opts), "tmpfs", str(self.path)], check=True,
                       capture_output=True)

    def resize(self, mb: int) -> None:
        self._mount("remount", f"size={mb}m")


@pytest.fixture
def small_disk(tmp_path):
    """A mounted 16 MB tmpfs; skipped where mounting is not allowed (not root, no CAP_SYS_ADMIN): then the
    `ulimit -f` (EFBIG) cases of the same tests still run the same code."""
    import subprocess

    disk = SmallDisk(tmp_path / "small_disk")
    disk.path.mkdir()
    try:
        disk._mount("size=16m")
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot mount a tmpfs here ({getattr(e, 'stderr', b'') or e}); the ulimit -f cases still run")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk.path)], capture_output=True)
