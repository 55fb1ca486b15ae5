"""The Makefile's setup checks, run for real on a throwaway VENV (they stop before anything is installed)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_use_system_torch_on_a_python_without_torch_is_one_line(tmp_path):
    # make's own last line is `make[1]: *** ...` when the suite itself runs under make (CI)
    venv, python = tmp_path / "venv", f"{sys.executable} -S"  # -S: no site-packages, so no torch
    r = subprocess.run(["make", "-s", "-C", str(ROOT), "install", f"VENV={venv}", f"PYTHON={python}",
                        "USE_SYSTEM_TORCH=1"], check=False, capture_output=True, text=True, timeout=120)
    lines = r.stderr.splitlines()
    assert r.returncode != 0 and len(lines) == 2 and re.match(r"make(\[\d+\])?: \*\*\* ", lines[1]), r.stderr
    assert lines[0] == (f"USE_SYSTEM_TORCH=1 but {python} ({sys.executable}) has no torch; "
                        "install torch into it first, or drop USE_SYSTEM_TORCH")
    assert not venv.exists()  # stopped before making the venv
