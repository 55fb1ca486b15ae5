"""The test harness itself: run_ranks fails the test at the first failure of a rank, a native crash (with the
stacks faulthandler wrote) as well as a Python exception, and never runs the ranks again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.launch import run_ranks


def _abort_first_time(marker: str) -> int:
    """Rank 1 aborts (SIGABRT, as a native crash does) the first time; a second run would return pids."""
    if os.environ["RANK"] == "1" and not Path(marker).exists():
        Path(marker).touch()
        os.abort()
    return os.getpid()


def _raise() -> None:
    raise ValueError("a Python error in a rank")


def test_a_native_crash_fails_at_once_with_the_stacks(tmp_path, recwarn):
    marker = tmp_path / "crashed"
    with pytest.raises(AssertionError) as e:
        run_ranks(2, _abort_first_time, str(marker))
    msg = str(e.value)
    assert "SIGABRT" in msg, msg
    # faulthandler's dump of the crashed rank: where it happened, in the report
    assert "result.pkl.err1.fault" in msg and "Fatal Python error: Aborted" in msg and "_abort_first_time" in msg, msg
    assert marker.exists() and not recwarn.list  # ran once: no rerun, no warning instead of a failure


def test_a_python_error_fails_with_its_traceback():
    with pytest.raises(AssertionError, match="ValueError: a Python error in a rank"):
        run_ranks(2, _raise)
