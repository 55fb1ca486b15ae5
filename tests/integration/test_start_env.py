"""The real CLI: an environment setting that would stop the process group is one line, before it starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug.toml")


def test_a_gloo_interface_that_does_not_exist_is_one_line(tmp_path, corpus):
    # gloo is the CPU backend (and, on GPUs, the host-side and async-checkpoint groups'): without the check,
    # gloo's `Unable to find address for: bogus0` traceback
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "bogus0"}
    p = subprocess.run([sys.executable, "-m", "shardlm", "train", "--config", DEBUG, f"--data.path={corpus}",
                        "--data.seq_len=64", f"--data.cache_dir={tmp_path / 'cache'}", "--train.micro_batch_size=4",
                        "--train.steps=2", f"--train.output_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT, check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stdout + p.stderr
    [line] = p.stderr.strip().splitlines()
    assert line.startswith("shardlm: error: GLOO_SOCKET_IFNAME=bogus0: no interface bogus0"), line
    assert "unset it" in line
    assert not (tmp_path / "cache").exists() and "prepare:" not in p.stdout  # said before any data preparation
