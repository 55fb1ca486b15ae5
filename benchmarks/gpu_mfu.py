"""GPU throughput: tokens/s, MFU and peak memory of shardlm on ONE GPU (H100/H200/A100/B200).

    python benchmarks/gpu_mfu.py [--steps 30] [--save]            # writes benchmarks/results/gpu_mfu.txt

shardlm need not be installed (src/ is put on PYTHONPATH); it needs tomli-w, and the fp8 rows need
torchao (a release built for the machine's torch: 0.17 for torch 2.11). On a lent GPU machine without
them (see /work/.library/device/README.md), fetch the wheels here and carry `.whl`:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl torchao==0.17.0 tomli-w==1.2.0
    # on the device, one call:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site \
        && python3 benchmarks/gpu_mfu.py --save

Models: a llama3_1b-shaped and a llama3_8b-shaped model with layers reduced so that full training fits
one GPU (params + grads + AdamW ~ 16 bytes/param), each in bf16, bf16 + torch.compile, and
fp8 (torchao tensorwise) + compile. Data: the built-in corpus with the byte tokenizer (the vocab
size stays the preset's: the embedding and head cost what they cost in the real model). Every
figure comes from shardlm's own metrics records (steady state: records after the first third of
the steps); each configuration runs in a fresh process so compile caches and memory don't carry over.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT, report  # noqa: E402

MODELS = {  # name: (preset, overrides)
    "llama3_1b": ("llama3_1b", {}),
    "llama3_8b (8 of 32 layers)": ("llama3_8b", {"model.n_layers": 8}),
}
PRECISIONS = {
    "bf16": {"train.mixed_precision": "bf16"},
    "bf16+compile": {"train.mixed_precision": "bf16", "train.compile": True},
    "fp8+compile": {"train.mixed_precision": "fp8", "train.fp8_recipe": "tensorwise", "train.compile": True},
}


def run_one(preset: str, overrides: dict, steps: int, out: Path) -> dict:
    o = {"model.preset": preset, "train.steps": steps, "train.output_dir": out, "train.device": "cuda",
         "train.micro_batch_size": 2, "train.warmup_steps": 5, "data.seq_len": 4096, "metrics.log_every": 1,
         "metrics.progress_bar": False, "checkpoint.save_final": False, "checkpoint.resume": "none", **overrides}
    cmd = [sys.executable, "-m", "shardlm", "train", *[f"--{k}={v}" for k, v in o.items()]]
    path = os.pathsep.join(x for x in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if x)  # installed or not
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path})
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:160]}
    banner = next((ln for ln in p.stdout.splitlines() if ln.startswith("shardlm: ")), "")
    if "fp8" in str(overrides.get("train.mixed_precision")) and "float8 all-gather" not in banner:
        return {"error": f"float8 all-gather was not enabled: {banner[:160]}"}
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = recs[len(recs) // 3:]
    med = lambda k: statistics.median(r[k] for r in steady)  # noqa: E731
    return {"tokens_per_sec": med("tokens_per_sec"), "mfu": med("mfu") if steady[0]["mfu"] is not None else None,
            "mem_gib": max(r["mem_gib"] for r in steady), "loss": recs[-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_mfu.py needs a CUDA GPU")
    lines = [f"shardlm on 1x {torch.cuda.get_device_name()} | torch {torch.__version__} | seq 4096 x micro-batch 2 | "
             f"{args.steps} steps, medians of the last two thirds", "",
             f"{'model':<28} {'precision':<14} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9}"]
    for mname, (preset, mo) in MODELS.items():
        for pname, po in PRECISIONS.items():
            with tempfile.TemporaryDirectory() as d:
                r = run_one(preset, {**mo, **po}, args.steps, Path(d))
            if "error" in r:
                lines.append(f"{mname:<28} {pname:<14} failed: {r['error']}")
            else:
                mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
                lines.append(f"{mname:<28} {pname:<14} {r['tokens_per_sec']:>10,.0f} {mfu:>7} {r['mem_gib']:>9.1f}")
            print(lines[-1], flush=True)
    report(lines, ROOT / "benchmarks" / "results" / "gpu_mfu.txt" if args.save else None)

if __name__ == "__main__":
    main()
