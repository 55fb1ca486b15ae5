"""Long context: what context parallelism (parallel.cp) buys in planned GPU memory, and what it costs on a CPU.

    python benchmarks/long_context.py [--part plan|cpu|both] [--save]

(1) plan: `shardlm plan` (offline, fake tensors) of Llama-3.1-8B (full fine-tune) on 8 x 80 GiB and Llama-3.1-70B
    (LoRA r16, bf16 base: a full fine-tune's state alone is 70 GiB per GPU there) on 16 x 80 GiB (2 nodes) at 32k, 64k and 128k tokens per sequence, micro-batch 1, bf16, full AC, chunked loss (8192 tokens),
    without CP and with cp = 8 (a CP group per node). The per-GPU total (`= on the GPU`) and the verdict.
    The planner itself is held against torchtitan's published CP runs in plan_vs_published.py (rows A8-A10).
(2) cpu: tokens/s of the debug model (fp32, gloo, 2 cores) at equal tokens per step (2 sequences of 512):
    one rank (cp 1), two ranks dp 2 (FSDP, cp 1) and two ranks cp 2 (each sequence split over both). The CP
    run pays two all-to-alls per attention layer forward (four with backward) on gloo; on one node of GPUs
    they ride NVLink. Three rounds, interleaved; the median per setting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "long_context.txt"
GIB = 2**30
PLAN_CASES = [("llama3_8b", 1, 8, []),  # preset, nodes, gpus per node, what trains (full fine-tune / LoRA)
              ("llama3_70b", 2, 8, ["--lora.rank=16", "--lora.alpha=32"])]  # 70B full: 70 GiB/GPU of state alone
SEQS = (32768, 65536, 131072)
PLAN_ARGS = ["--train.micro_batch_size=1", "--train.mixed_precision=bf16", "--train.ac=full",
             "--train.loss_chunk_tokens=8192", "--train.grad_accum=1"]


def plan_rows() -> list[str]:
    from shardlm.config import load_config
    from shardlm.plan import plan

    lines = [f"{'model':<16} {'GPUs':>7} {'seq_len':>8} {'cp 1 (GiB)':>12} {'cp 8 (GiB)':>12}  verdict (80 GiB, 10% headroom)"]
    for preset, nodes, per, trains in PLAN_CASES:
        world = nodes * per
        for seq in SEQS:
            cells, fits = [], []
            for cp in (1, 8):
                cfg = load_config(None, [f"--model.preset={preset}", f"--data.seq_len={seq}", f"--parallel.cp={cp}",
                                         *PLAN_ARGS, *trains])
                r = plan(cfg, world, 80, per, alternatives=False)
                cells.append(r.base.peak_bytes / GIB)
                fits.append(r.fits)
            verdict = {(False, True): "fits only with CP", (True, True): "fits either way",
                       (False, False): "fits neither way", (True, False): "?"}[tuple(fits)]
            name = preset + (" LoRA" if trains else "")
            lines.append(f"{name:<16} {f'{nodes}x{per}':>7} {seq:>8} {cells[0]:>12.2f} {cells[1]:>12.2f}  {verdict}")
    return lines


def _cpu_run(out: Path, ranks: int, cp: int, mbs: int) -> float:
    steps = 12
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m", "shardlm",
           "train", "--config", str(ROOT / "configs" / "debug.toml"), f"--train.output_dir={out}",
           f"--train.steps={steps}", f"--train.micro_batch_size={mbs}", "--data.seq_len=512", f"--parallel.cp={cp}",
           "--train.mixed_precision=fp32", "--metrics.log_every=1", "--metrics.progress_bar=false",
           "--checkpoint.save_final=false", "--train.sample_tokens=0", "--eval.at_end=false"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_sec"] for r in recs[3:])  # after warm-up


def cpu_rows(rounds: int = 3) -> list[str]:
    settings = [("1 rank, cp 1", 1, 1, 2), ("2 ranks, dp 2", 2, 1, 1), ("2 ranks, cp 2", 2, 2, 2)]
    seen: dict[str, list[float]] = {name: [] for name, *_ in settings}
    with tempfile.TemporaryDirectory() as d:
        for r in range(rounds):
            for name, ranks, cp, mbs in settings:
                seen[name].append(_cpu_run(Path(d) / f"{r}_{ranks}_{cp}", ranks, cp, mbs))
    base = statistics.median(seen["1 rank, cp 1"])
    lines = ["debug model (0.87M params), fp32, 2 x 512 tokens per step, gloo on 2 CPU cores; median tokens/s of "
             f"{rounds} interleaved rounds (steps 4-12 of each)"]
    for name, *_ in settings:
        med = statistics.median(seen[name])
        lines.append(f"  {name:<14} {med:>9.0f} tokens/s  {med / base:.2f}x of one rank   rounds: "
                     + ", ".join(f"{x:.0f}" for x in seen[name]))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("plan", "cpu", "both"), default="both")
    ap.add_argument("--save", action="store_true", help=f"write the report to {RESULT.relative_to(ROOT)}")
    args = ap.parse_args()
    lines = ["long context: planned GPU memory with and without context parallelism, and its cost on a CPU", ""]
    if args.part in ("plan", "both"):
        lines += ["(1) `shardlm plan`, per GPU, micro-batch 1, bf16, full AC, chunked loss (8192):", *plan_rows(), ""]
    if args.part in ("cpu", "both"):
        lines += ["(2) CPU throughput at equal tokens per step:", *cpu_rows(), ""]
    text = "\n".join(lines)
    print(text)
    if args.save:
        RESULT.write_text(text + "\n")


if __name__ == "__main__":
    main()
