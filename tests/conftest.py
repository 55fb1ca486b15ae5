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
