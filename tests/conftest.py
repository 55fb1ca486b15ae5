"""Shared fixtures: a small corpus made from local files, so no test downloads anything.

tests/ goes on sys.path here, once, so that every test module imports the test-only code as
`helpers.<module>` (tests/helpers/), and so do the ranks `helpers.launch.run_ranks` forks (their forkserver
starts with this process's sys.path)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from helpers.disk import SmallDisk  # noqa: E402

from shardlm.data.sources import builtin_files  # noqa: E402


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


@pytest.fixture
def small_disk(tmp_path):
    """A mounted 16 MB tmpfs; skipped where mounting is not allowed (not root, no CAP_SYS_ADMIN): then the
    `ulimit -f` (EFBIG) cases of the same tests still run the same code."""
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
