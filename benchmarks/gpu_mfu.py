"""GPU throughput: tokens/s, MFU and peak memory of shardlm's fast paths, side by side, on ONE GPU run.

    python benchmarks/gpu_mfu.py                      # every variant below; writes benchmarks/results/gpu_mfu.txt
    python benchmarks/gpu_mfu.py --only bf16,cudnn,flash
    python benchmarks/gpu_mfu.py --variant "nf4-r16:--lora.rank=16 --lora.base_dtype=nf4"   # add one by name
    python benchmarks/gpu_mfu.py --dry-run            # the same pipeline on CPU: debug model, 2 steps (a test)

Each variant is the baseline (bf16, every setting at its default: train.attention_backend=auto,
parallel.reshard_after_forward=auto, parallel.prefetch=1, train.loss_chunk_tokens=4096) plus its own
`--section.key=value` overrides, run as `shardlm train` in a fresh process (compile caches and memory don't
carry over). Figures come from shardlm's own metrics records (steady state: the records after the first
third of the steps); the `chosen` column is what the startup line says the trainer picked. A variant whose
key this shardlm lacks, or whose extra (torchao) is not installed, is skipped with a line; one the trainer
refuses (e.g. cuDNN attention on a GPU without it) is a `failed:` line with the trainer's one-line reason.

On one GPU, FSDP has nothing to communicate: reshard_after_forward and prefetch then measure FSDP's own
copies only (their gain is in multi-GPU all-gathers; pass --gpus N on a machine with N GPUs).

shardlm need not be installed (src/ is put on PYTHONPATH); it needs tomli-w, and the fp8, int8-optimizer
and nf4 rows need torchao (a release built for the machine's torch: 0.17 for torch 2.11). On a lent GPU
machine without them (see /work/.library/device/README.md), fetch the wheels here and carry `.whl`:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl torchao==0.17.0 tomli-w==1.2.0
    # on the device, one call:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site \
        && python3 benchmarks/gpu_mfu.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (overrides on top of the baseline, extras it needs). Later engineers add rows here by name.
VARIANTS: dict[str, tuple[dict[str, object], tuple[str, ...]]] = {
    "bf16": ({}, ()),
    "cudnn": ({"train.attention_backend": "cudnn"}, ()),
    "flash": ({"train.attention_backend": "flash"}, ()),
    "reshard-true": ({"parallel.reshard_after_forward": True}, ()),
    "prefetch2": ({"parallel.prefetch": 2}, ()),
    "ce-unchunked": ({"train.loss_chunk_tokens": 0}, ()),
    "compile": ({"train.compile": True}, ()),
    "fp8-compile": ({"train.mixed_precision": "fp8", "train.fp8_recipe": "tensorwise", "train.compile": True},
                    ("torchao",)),
    "optim-bf16": ({"train.optimizer_state_dtype": "bf16"}, ()),
    "optim-int8": ({"train.optimizer_state_dtype": "int8"}, ("torchao",)),
    "lora-bf16": ({"lora.rank": 16}, ()),
    "lora-nf4": ({"lora.rank": 16, "lora.base_dtype": "nf4"}, ("torchao",)),
}
GPU_BASE = {"model.preset": "llama3_8b", "model.n_layers": 4, "data.seq_len": 4096, "train.micro_batch_size": 2,
            "train.device": "cuda", "train.mixed_precision": "bf16"}
CPU_BASE = {"model.preset": "debug", "data.seq_len": 64, "train.micro_batch_size": 2, "train.device": "cpu",
            "train.mixed_precision": "fp32", "data.tokenizer": "bytes"}
COMMON = {"train.warmup_steps": 2, "metrics.log_every": 1, "metrics.progress_bar": False,
          "checkpoint.save_final": False, "checkpoint.resume": "none"}


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """`NAME:--a.b=v --c.d=w` -> (NAME, {"a.b": "v", "c.d": "w"})."""
    name, _, rest = spec.partition(":")
    overrides = {}
    for arg in shlex.split(rest.replace(",--", " --")):
        key, eq, value = arg.removeprefix("--").partition("=")
        if not eq or not key:
            raise SystemExit(f"--variant {spec!r}: write NAME:--section.key=value [--section.key=value ...]")
        overrides[key] = value
    return name.strip(), overrides


def why_skipped(overrides: dict, needs: tuple[str, ...]) -> str | None:
    """A missing extra, or a key / value this shardlm does not take (its config error), else None."""
    from shardlm.config import load_config
    from shardlm.errors import ConfigError

    for module in needs:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    try:
        load_config(None, [f"--{k}={v}" for k, v in overrides.items()])
    except ConfigError as e:
        return str(e)
    return None


def run_one(overrides: dict, out: Path, gpus: int, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "shardlm", "train", *[f"--{k}={v}" for k, v in overrides.items()]]
    if gpus > 1:
        cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", "-m", "shardlm"]
    path = os.pathsep.join(x for x in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if x)  # installed or not
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                           env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()] or ["?"]
        line = next((ln for ln in reversed(lines) if ln.startswith("shardlm: error")), lines[-1])
        return {"error": line[:200]}
    # the startup line (the first `shardlm: ` line that describes the run, not a note printed before it)
    banner = next((ln for ln in p.stdout.splitlines() if ln.startswith("shardlm: ") and "tokens/step | " in ln), "")
    if overrides.get("train.mixed_precision") == "fp8" and overrides.get("train.device") == "cuda" \
            and "float8 all-gather" not in banner:
        return {"error": f"float8 all-gather was not enabled: {banner[:160]}"}
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "tokens_per_sec" in r]
    steady = recs[len(recs) // 3:]
    med = lambda k: statistics.median(r[k] for r in steady)  # noqa: E731
    return {"tokens_per_sec": med("tokens_per_sec"), "mfu": med("mfu") if steady[0]["mfu"] is not None else None,
            "mem_gib": max(r["mem_gib"] for r in steady), "loss": recs[-1]["loss"], "wall_s": wall,
            "chosen": banner.rpartition("tokens/step | ")[2] if banner else
            f"? (no startup line in the run's output: {p.stdout.strip()[:300]!r})"}


def row(name: str, r: dict, base: dict | None) -> list[str]:
    if "skipped" in r:
        return [f"{name:<14} skipped: {r['skipped']}"]
    if "error" in r:
        return [f"{name:<14} failed: {r['error']}"]
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    vs = f"{r['tokens_per_sec'] / base['tokens_per_sec']:.2f}x" if base and "tokens_per_sec" in base else "-"
    return [f"{name:<14} {r['tokens_per_sec']:>10,.0f} {vs:>7} {mfu:>7} {r['mem_gib']:>9.2f} {r['loss']:>8.4f} "
            f"{r['wall_s']:>6.0f}s", f"{'':<14} chosen: {r['chosen']}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:--section.key=value ...",
                    help="an extra variant (repeatable): the baseline plus these overrides")
    ap.add_argument("--set", action="append", default=[], metavar="section.key=value",
                    help="change the baseline of every variant (e.g. model.n_layers=8)")
    ap.add_argument("--gpus", type=int, default=1, help="ranks per run (torchrun) on a multi-GPU machine")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per variant")
    ap.add_argument("--dry-run", action="store_true", help="on CPU: the debug model, 2 steps (checks the pipeline)")
    ap.add_argument("--out", type=Path, default=None, help="report file (default benchmarks/results/gpu_mfu.txt; "
                    "none for --dry-run)")
    args = ap.parse_args()
    variants = {k: (dict(v), needs) for k, (v, needs) in VARIANTS.items()}
    for spec in args.variant:
        name, overrides = parse_variant(spec)
        variants[name] = (overrides, ())
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in variants]
        if unknown:
            raise SystemExit(f"--only: unknown variant(s) {', '.join(unknown)}; known: {', '.join(variants)}")
        variants = {n: variants[n] for n in names + [s.partition(":")[0].strip() for s in args.variant]
                    if n in variants}
    import torch

    if args.dry_run:
        base, steps, where = dict(CPU_BASE), 2, f"CPU dry run (debug model), torch {torch.__version__}"
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_mfu.py needs a CUDA GPU (or --dry-run on CPU)")
        base, steps = dict(GPU_BASE), args.steps
        where = f"{args.gpus}x {torch.cuda.get_device_name()} | torch {torch.__version__}"
    for kv in args.set:
        key, _, value = kv.partition("=")
        base[key] = value
    out = args.out if args.out or args.dry_run else ROOT / "benchmarks" / "results" / "gpu_mfu.txt"
    shape = f"{base['model.preset']}" + (f" ({base['model.n_layers']} layers)" if "model.n_layers" in base else "")
    lines = [f"shardlm fast paths on {where} | {shape}, seq {base['data.seq_len']} x micro-batch "
             f"{base['train.micro_batch_size']} | {steps} steps, medians of the last two thirds | vs = tokens/s "
             f"over the first row", "",
             f"{'variant':<14} {'tokens/s':>10} {'vs':>7} {'MFU':>7} {'peak GiB':>9} {'loss':>8} {'wall':>7}"]
    for line in lines:
        print(line, flush=True)
    first: dict | None = None
    for name, (extra, needs) in variants.items():
        overrides = {**base, **COMMON, "train.steps": steps, **extra}
        skip = why_skipped({k: v for k, v in overrides.items() if k != "train.output_dir"}, needs)
        if skip is not None:
            r = {"skipped": skip}
        else:
            with tempfile.TemporaryDirectory() as d:
                r = run_one({**overrides, "train.output_dir": d}, Path(d), args.gpus, args.timeout)
        first = first or (r if "tokens_per_sec" in r else None)
        for line in row(name, r, first):
            lines.append(line)
            print(line, flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
        print(f"saved to {out}", flush=True)


if __name__ == "__main__":
    main()
