"""GPU memory: what `shardlm plan` says beside what torch.cuda measures, for configurations scaled to one GPU.

    python benchmarks/gpu_memory.py [--only NAME,NAME] [--steps 6]   # on a GPU: writes results/gpu_memory.txt
    python benchmarks/gpu_memory.py --dry-run                        # on CPU: the debug model (checks the pipeline)

Each configuration runs as `shardlm train` in a fresh process on one GPU, logging every step: `mem_gib` is
`torch.cuda.max_memory_allocated()` and `mem_reserved_gib` `max_memory_reserved()` of that step (the trainer resets
the counters after each log). The steady state is the largest of the steps after the second (the optimizer state
exists). Beside it, `shardlm plan` of the same configuration on one GPU of this device's size: the tensors' peak +
the cuBLAS workspaces (what max_memory_allocated counts) and the replayed allocator's reserved peak
(`shardlm.plan.allocator`), with the ratios planned / measured. The configurations are those of the published
rows (benchmarks/plan_vs_published.py) cut to what one GPU holds: full fine-tuning with per-op SAC and an unchunked
loss (torchtitan's), LoRA on a bf16 base and QLoRA with full AC (torchtune's); random weights (memory does not
depend on them), the bytes tokenizer on the standard library's text. On the device, carry torchao for QLoRA (see
benchmarks/gpu_mfu.py). Run it with gpu_mfu.py in one prepared call when a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = {"data.tokenizer": "bytes", "metrics.log_every": 1, "metrics.progress_bar": False,
          "checkpoint.save_final": False, "checkpoint.resume": "none", "train.warmup_steps": 2}
CONFIGS = {  # name: overrides (on one GPU)
    "1b-full-sac": {"model.preset": "llama3_1b", "data.seq_len": 4096, "train.micro_batch_size": 2,
                    "train.ac": "selective_op", "train.mixed_precision": "bf16", "train.loss_chunk_tokens": 0,
                    "parallel.reshard_after_forward": True},
    "8b-lora-bf16": {"model.preset": "llama3_8b", "data.seq_len": 2048, "train.micro_batch_size": 2,
                     "train.ac": "full", "train.mixed_precision": "bf16", "lora.rank": 16, "lora.alpha": 32,
                     "lora.base_dtype": "bf16", "train.loss_chunk_tokens": 512, "parallel.reshard_after_forward": True},
    "8b-qlora": {"model.preset": "llama3_8b", "data.seq_len": 4096, "train.micro_batch_size": 1, "train.ac": "full",
                 "train.mixed_precision": "bf16", "lora.rank": 16, "lora.alpha": 32, "lora.base_dtype": "nf4",
                 "parallel.reshard_after_forward": True},
}
DRY = {"dry-debug": {"model.preset": "debug", "data.seq_len": 64, "train.micro_batch_size": 2,
                     "train.device": "cpu", "train.mixed_precision": "fp32"}}


def measure(overrides: dict, steps: int, timeout: float) -> dict:
    """Run `shardlm train`; the steady peaks (GiB) from its metrics, or {"error": line}."""
    with tempfile.TemporaryDirectory() as d:
        args = {**COMMON, **overrides, "train.steps": steps, "train.output_dir": d}
        cmd = [sys.executable, "-m", "shardlm", "train", *[f"--{k}={v}" for k, v in args.items()]]
        path = os.pathsep.join(x for x in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if x)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path})
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f}s"}
        if p.returncode != 0:
            lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()] or ["?"]
            return {"error": next((ln for ln in reversed(lines) if ln.startswith("shardlm: error")), lines[-1])[:200]}
        recs = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        steady = [r for r in recs if "mem_gib" in r][2:] or [r for r in recs if "mem_gib" in r]
        reserved = [r["mem_reserved_gib"] for r in steady if r.get("mem_reserved_gib") is not None]
        return {"allocated": max(r["mem_gib"] for r in steady), "reserved": max(reserved) if reserved else None}


def planned(overrides: dict, gpu_gib: float) -> dict:
    from shardlm.config import load_config
    from shardlm.plan import GIB, plan

    cfg = load_config(None, [f"--{k}={v}" for k, v in {**COMMON, **overrides}.items()])
    r = plan(cfg, world_size=1, gpu_mem_gib=gpu_gib, gpus_per_node=1, alternatives=False)
    d = r.base.device
    return {"allocated": (d.tensors + d.cublas) / GIB, "reserved": d.reserved / GIB, "total": d.total / GIB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", default="")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--dry-run", action="store_true", help="on CPU: the debug model, 3 steps")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    import torch

    if a.dry_run:
        configs, gpu_gib, where, steps = DRY, 80.0, f"CPU dry run, torch {torch.__version__}", 3
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_memory.py needs a CUDA GPU (or --dry-run on CPU)")
        configs, steps = CONFIGS, a.steps
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        where = f"{torch.cuda.get_device_name()} ({gpu_gib:.1f} GiB) | torch {torch.__version__}"
    if a.only:
        configs = {k: v for k, v in configs.items() if k in a.only.split(",")}
    out = a.out if a.out or a.dry_run else ROOT / "benchmarks" / "results" / "gpu_memory.txt"
    lines = [f"shardlm plan vs torch.cuda on {where} | {steps} steps; GiB; ratio = planned / measured", "",
             f"{'config':<14} {'alloc planned':>13} {'measured':>9} {'ratio':>6} {'reserved planned':>16} "
             f"{'measured':>9} {'ratio':>6}"]
    print("\n".join(lines), flush=True)
    for name, overrides in configs.items():
        t0 = time.perf_counter()
        m = measure(overrides, steps, a.timeout)
        if "error" in m:
            line = f"{name:<14} failed: {m['error']}"
        else:
            p = planned(overrides, gpu_gib)
            res = (f"{p['reserved']:>16.2f} {m['reserved']:>9.2f} {p['reserved'] / m['reserved']:>6.2f}"
                   if m["reserved"] else f"{p['reserved']:>16.2f} {'-':>9} {'-':>6}")
            line = (f"{name:<14} {p['allocated']:>13.2f} {m['allocated']:>9.2f} {p['allocated'] / m['allocated']:>6.2f} "
                    f"{res}  ({time.perf_counter() - t0:.0f}s)")
        lines.append(line)
        print(line, flush=True)
    if a.dry_run:
        lines.append("(dry run: on CPU the measured figure is the process's peak RSS, not comparable)")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
