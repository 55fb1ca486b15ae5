"""The real CLI: `shardlm train` alone and under torchrun on the debug model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardlm.config import load_config
from shardlm.observe.metrics import FIELDS

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug.toml")


def _run(args: list[str], torchrun: int = 0, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"] \
        if torchrun else [sys.executable]
    return subprocess.run(launcher + ["-m", "shardlm", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def _small(tmp_path: Path, corpus: Path) -> list[str]:
    return [f"--data.path={corpus}", "--data.seq_len=64", f"--data.cache_dir={tmp_path / 'cache'}",
            "--train.micro_batch_size=4", f"--train.output_dir={tmp_path / 'run'}"]


@pytest.mark.slow
def test_torchrun_two_ranks_trains_and_writes_outputs(tmp_path, corpus):
    p = _run(["train", "--config", DEBUG, *_small(tmp_path, corpus), "--train.steps=40", "--metrics.log_every=5",
              "--train.warmup_steps=5", "--train.sample_tokens=20"], torchrun=2)
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(5, 41, 5))
    # on a CPU, only what matters on a CPU: no NCCL or CUDA variables, no torchrun warning about them, no MFU
    # column with nothing in it, no empty comm_traces/ folder
    said = p.stdout + p.stderr
    assert "NCCL" not in said and "CUDA_ALLOC" not in said and "mfu" not in said, said[-3000:]
    assert not (run / "comm_traces").exists()
    for r in records:
        assert set(r) == set(FIELDS)
        assert r["mfu"] is None and r["tokens_per_sec"] > 0 and r["mem_gib"] > 0 and r["grad_norm"] > 0
        assert r["mem_reserved_gib"] is None  # CUDA only: the caching allocator's reserved peak
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, [r["loss"] for r in records]
    resolved = load_config(run / "config.toml")
    assert resolved.train.steps == 40 and resolved.data.seq_len == 64
    assert "2 rank(s) on cpu (gloo), mesh dp_shard=2" in p.stdout
    assert "sample:" in p.stdout and f"outputs in {run}" in p.stdout


def test_single_process_run(tmp_path, corpus):
    # The debug config's mixed_precision is `auto`: fp32 on this CPU, said at startup. An empty sample
    # prompt starts the sample from end-of-text (it used to be a traceback).
    p = _run(["train", "--config", DEBUG, *_small(tmp_path, corpus), "--train.steps=4", "--metrics.log_every=2",
              "--train.sample_tokens=5", "--train.sample_prompt="])
    assert p.returncode == 0, p.stderr[-3000:]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    assert "fp32 (train.mixed_precision=auto on cpu)" in p.stdout + p.stderr and "sample:" in p.stdout + p.stderr


@pytest.mark.parametrize("override, needle", [
    ("--train.stepz=5", "unknown config key 'train.stepz'; did you mean 'train.steps'?"),
    ("--train.steps=abc", "train.steps expects int, got 'abc'"),
    ("--model.preset=llama9", "unknown model preset 'llama9'; did you mean 'llama3_8b'? valid presets: debug, llama3_1b"),
    ("--parallel.dp_shard=2", "mesh parallel.dp_replicate=1 x parallel.dp_shard=2 = 2 ranks, but the world size is 1"),
])
def test_bad_input_is_one_clear_line(tmp_path, corpus, override, needle):
    p = _run(["train", "--config", DEBUG, *_small(tmp_path, corpus), override])
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardlm: error: ") and needle in lines[0], p.stderr


def test_missing_data_is_one_clear_line(tmp_path, corpus):
    p = _run(["train", "--config", DEBUG, *_small(tmp_path, corpus), f"--data.path={tmp_path / 'none.txt'}"])
    assert p.returncode != 0 and p.stderr.strip().splitlines() == [
        f"shardlm: error: data.path '{tmp_path / 'none.txt'}' does not exist; pass a token store (store:DIR), a file "
        "(.txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, .arrow or a `datasets` save_to_disk folder), a directory, a "
        "glob or builtin:stdlib"]


def test_help_lists_config_keys():
    p = _run(["train", "--help"])
    assert p.returncode == 0 and "train.micro_batch_size" in p.stdout and "Sequences per rank" in p.stdout


def test_nonfinite_step_is_one_line_and_exit_code_6(tmp_path, corpus):
    """A run that diverges (lr far too high, no clipping) stops before the bad update, naming step and cause."""
    from shardlm.errors import TrainingError

    p = _run(["train", "--config", DEBUG, *_small(tmp_path, corpus), "--train.steps=20", "--train.lr=1e6",
              "--train.grad_clip=0", "--train.warmup_steps=0", "--checkpoint.interval=1"])
    assert p.returncode == TrainingError.exit_code == 6, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardlm: error: non-finite optimizer step "), p.stderr
    bad = int(lines[0].split("optimizer step ")[1].split(":")[0])
    saved = sorted(int(d.name.split("-")[1]) for d in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert saved and saved[-1] == bad - 1  # every good step was saved; the bad one was not
