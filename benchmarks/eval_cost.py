"""The cost of validation in the loop on training throughput (CPU, 2 gloo ranks, the debug model).

    python benchmarks/eval_cost.py [--steps 60] [--rounds 2] [--save]

One token store with a 5% validation split (`shardlm prepare --val-fraction 0.05` of a stdlib text corpus, byte
tokenizer), then `torchrun --nproc_per_node 2 -m shardlm train` on it with eval.interval = 0 (off), 20 and 5
(eval.max_tokens 16384: 256 windows of 64, 128 per rank), alternating the order between rounds. Reported per
setting (medians over --rounds): wall time of the training loop (the last record's elapsed_s), the evaluation
time it contains (sum of val_time_s), tokens/s of training = trained tokens / (elapsed - eval), and the slowdown
of the whole loop against eval off. Check: the training losses are identical with and without evaluation
(exit status 1 if not).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, report  # noqa: E402


def _corpus(d: Path) -> Path:
    from shardlm.data.sources import builtin_files

    docs, size = [], 0
    for f in builtin_files(max_depth=0):
        text = f.read_text(encoding="utf-8", errors="ignore")
        docs += [text[i : i + 2000] for i in range(0, len(text), 2000)]
        size += len(text)
        if size > 3_000_000:
            break
    out = d / "docs.jsonl"
    out.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return out


def _train(store: Path, out: Path, steps: int, interval: int) -> list[dict]:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "shardlm",
            "train", "--model.preset=debug", f"--train.steps={steps}", f"--train.output_dir={out}",
            "--train.micro_batch_size=4", "--data.seq_len=64", "--data.tokenizer=bytes", f"--data.path=store:{store}",
            "--metrics.log_every=5", "--metrics.progress_bar=false", "--checkpoint.save_final=false",
            "--train.sample_tokens=0", "--train.mixed_precision=fp32", f"--eval.interval={interval}",
            "--eval.at_end=false", "--eval.max_tokens=16384"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        sys.exit(f"training failed:\n{r.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--save", action="store_true", help="write results/eval_cost_cpu.txt")
    a = ap.parse_args()
    settings = [0, 20, 5]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        subprocess.run([sys.executable, "-m", "shardlm", "prepare", str(_corpus(d)), str(d / "store"),
                        "--val-fraction", "0.05", "--data.tokenizer=bytes"], check=True, capture_output=True, cwd=ROOT)
        rows: dict[int, list[tuple[float, float, float]]] = {s: [] for s in settings}
        losses: dict[int, list[float]] = {}
        for rnd in range(a.rounds):
            for s in settings if rnd % 2 == 0 else settings[::-1]:
                recs = _train(d / "store", d / f"run-{s}-{rnd}", a.steps, s)
                train = [r for r in recs if "loss" in r]
                elapsed = recs[-1]["elapsed_s"]
                evals = sum(r.get("val_time_s", 0.0) for r in recs)
                tokens = a.steps * 2 * 4 * 64
                rows[s].append((elapsed, evals, tokens / (elapsed - evals)))
                losses[s] = [r["loss"] for r in train]
    base = statistics.median(e for e, _, _ in rows[0])
    lines = [f"eval cost, CPU, 2 gloo ranks, debug model (0.87M), {a.steps} steps of 2x4x64 tokens, "
             f"eval.max_tokens 16384, medians of {a.rounds} rounds"]
    for s in settings:
        el = statistics.median(e for e, _, _ in rows[s])
        ev = statistics.median(v for _, v, _ in rows[s])
        tps = statistics.median(t for _, _, t in rows[s])
        name = "eval off" if s == 0 else f"eval.interval={s}"
        lines.append(f"{name:<18} loop {el:6.2f}s  of which eval {ev:5.2f}s  training {tps:8,.0f} tok/s  "
                     f"loop x{el / base:.2f} vs off")
    same = all(losses[s] == losses[0] for s in settings)
    lines.append(f"training losses identical with and without eval: {same}")
    report(lines, ROOT / "benchmarks" / "results" / "eval_cost_cpu.txt" if a.save else None)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
