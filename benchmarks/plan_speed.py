"""How long does `shardlm plan` take, and what does planning from two short fake steps cost in accuracy?

    python benchmarks/plan_speed.py [--save]        # writes benchmarks/results/plan_speed_cpu.txt

For each case the planner runs twice in this process, side by side: as shipped (deep models planned
from two fake steps of 10-11 layers, or 12-14 with train.ac=selective, see `shardlm.plan._extrapolate`)
and with `exact=True` (a fake step through every layer). Printed: the wall time of each, the
per-rank peak of each, and whether the two agree on every memory category to the byte. Then one
full `shardlm plan` with its alternatives (what a user runs) for llama3_70b on one 8-GPU node,
timed. CPU only; no GPU or process group needed.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from _common import ROOT, report  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))

from shardlm.config import load_config  # noqa: E402
from shardlm.plan import GIB, plan  # noqa: E402
from shardlm.plan.extrapolate import period_of, reduced_layers  # noqa: E402
from shardlm.plan.fake_step import model_config  # noqa: E402

CASES = [  # (label, overrides, world size)
    ("llama3_8b full FT, 8 ranks", ["--model.preset=llama3_8b", "--data.seq_len=4096",
                                    "--train.micro_batch_size=1"], 8),
    ("llama3_70b full FT, ac=selective, 8 ranks", ["--model.preset=llama3_70b", "--data.seq_len=2048",
                                                   "--train.micro_batch_size=1", "--train.ac=selective"], 8),
    ("llama3_70b LoRA r=16, ac=full, 8 ranks", ["--model.preset=llama3_70b", "--data.seq_len=2048",
                                                "--train.micro_batch_size=1", "--lora.rank=16",
                                                "--train.ac=full"], 8),
    ("llama3_405b full FT, ac=full, 128 ranks", ["--model.preset=llama3_405b", "--data.seq_len=2048",
                                                 "--train.micro_batch_size=1", "--train.ac=full"], 128),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args()
    lines = [f"shardlm plan speed | {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs | "
             f"python {platform.python_version()}", "",
             f"{'case':<44} {'2 short steps':>14} {'every layer':>12} {'speed-up':>9} {'peak GiB':>9}  same bytes"]
    print(lines[0], flush=True)
    plan(load_config(None, ["--model.preset=debug"]), world_size=2, gpu_mem_gib=80)  # one-time costs: imports
    for label, overrides, ws in CASES:
        cfg = load_config(None, overrides)
        t0 = time.perf_counter()
        fast = plan(cfg, world_size=ws, gpu_mem_gib=80, alternatives=False)
        t1 = time.perf_counter()
        full = plan(cfg, world_size=ws, gpu_mem_gib=80, alternatives=False, exact=True)
        t2 = time.perf_counter()
        same = (fast.base.peak.raw == full.base.peak.raw and fast.base.model_state.raw == full.base.model_state.raw
                and fast.base.offload_peak_bytes == full.base.offload_peak_bytes)
        shallow = reduced_layers(model_config(cfg)[0].n_layers, period_of(cfg)) is None
        lines.append(f"{label:<44} {t1 - t0:>13.1f}s {t2 - t1:>11.1f}s {(t2 - t1) / (t1 - t0):>8.1f}x "
                     f"{fast.base.peak.total / GIB:>9.2f}  {'yes' if same else 'NO'}"
                     + ("  (too shallow to pay: both ran every layer)" if shallow else "")
                     + (f"  ({'; '.join(fast.notes)})" if any('ran all' in n for n in fast.notes) else ""))
        print(lines[-1], flush=True)
    cfg = load_config(None, CASES[1][1][:3])
    t0 = time.perf_counter()
    r = plan(cfg, world_size=8, gpu_mem_gib=80)
    lines += ["", f"full `shardlm plan` with alternatives, llama3_70b full FT on 1 x 8 x 80 GiB: "
                  f"{time.perf_counter() - t0:.1f}s, {len(r.alternatives)} alternatives, fits={r.fits}, "
                  f"most room: {r.best_alternative().name if r.best_alternative() else 'none'}"]
    print(lines[-1], flush=True)
    report(lines, ROOT / "benchmarks" / "results" / "plan_speed_cpu.txt" if args.save else None)

if __name__ == "__main__":
    main()
