"""The test harness itself: run_ranks runs a spawn again once when a rank dies of a native crash (with a
warning that names it), and fails on a second crash or on any Python exception."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from launch import run_ranks


def _abort_first_time(marker: str) -> int:
    """Rank 1 aborts (SIGABRT, as a native crash does) the first time; then every rank returns its pid."""
    if os.environ["RANK"] == "1" and not Path(marker).exists():
        Path(marker).touch()
        os.abort()
    return os.getpid()


def _always_abort() -> None:
    if os.environ["RANK"] == "1":
        os.abort()


def _raise() -> None:
    raise ValueError("a Python error in a rank")


def test_a_native_crash_runs_the_ranks_again_once(tmp_path):
    marker = tmp_path / "crashed"
    with pytest.warns(UserWarning, match="native crash, running the ranks again .1 of 1.*SIGABRT"):
        pid = run_ranks(2, _abort_first_time, str(marker))
    assert marker.exists() and pid != os.getpid()
    with pytest.warns(UserWarning, match="native crash"), pytest.raises(AssertionError, match="SIGABRT"):
        run_ranks(2, _always_abort)  # crashed again on the rerun: the test fails


def test_a_python_error_is_not_retried(tmp_path, recwarn):
    with pytest.raises(AssertionError, match="ValueError: a Python error in a rank"):
        run_ranks(2, _raise)
    assert not [w for w in recwarn if "native crash" in str(w.message)]
