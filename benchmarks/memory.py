"""Memory per rank and tokens/s of the memory features, side by side in one run (CPU, 2 gloo ranks), and the
planner's answer for the large configurations they are for.

    python benchmarks/memory.py [--steps 6] [--rounds 1] [--only NAME,NAME] [--save]

1. Training. One HF Llama written once to a temp dir (transformers LlamaConfig: hidden 512, 4 blocks, 8 heads,
   4 KV heads, intermediate 1536, vocab 16384, untied head; random init, fp32 safetensors: 29.2M parameters,
   12.6M of them in the blocks' linears), the demo tokenizer and SFT pairs of the stdlib (as benchmarks/lora.py).
   Every variant is `torchrun --nproc_per_node 2 -m shardlm train --model.init_from=hf:<dir>` on the same data
   (data.format=sft, seq_len 256, micro batch 2: 512 tokens per rank and micro-batch; fp32 compute: a CPU
   has no fast bf16; FSDP over both ranks; no checkpoints), 2 + --steps steps, each variant's settings on top:

     full             full fine-tuning (fp32 weights, gradients, AdamW moments)
     full-bf16-state  train.optimizer_state_dtype=bf16 (moments in bf16, fp32 master weights)
     full-int8-state  train.optimizer_state_dtype=int8 (torchao's 8-bit AdamW)
     mb8-unchunked    full, micro batch 8 (2048 tokens), train.loss_chunk_tokens=0: (2048, 16384) fp32 logits
     mb8-chunked      the same with train.loss_chunk_tokens=256: the head and the loss 256 tokens at a time
     lora             lora.rank=16 on the 7 projections, the frozen base as the training precision (fp32 here)
     lora-bf16-base   lora.base_dtype=bf16: the frozen base stored in bf16
     qlora            lora.base_dtype=nf4: the frozen linears in torchao NF4

   Reported per variant (medians over --rounds): peak RSS of rank 0 (the trainer's `mem_gib` on CPU:
   ru_maxrss, so it includes the ~0.5 GiB that importing torch costs every variant alike) and its difference
   from `full`; tokens/s over the steps after the first two (from metrics.jsonl); the last loss. A variant
   whose setting this shardlm does not have (an unknown key or a missing extra) is reported as skipped with
   the error's line. Beside it, the planner's answer for the same config on 2 ranks (`shardlm plan`: the per-rank
   peak and model state of the tensors, as FSDPMemTracker counts them; the accuracy tests hold it within 15% of
   a real run's tracker), since RSS also holds code and allocator caches; and the RSS that importing costs.
2. Planner (`shardlm plan --json`, offline, fake tensors): llama3_70b QLoRA (configs/llama3_70b_lora.toml with
   lora.base_dtype=nf4, on 1 node of 8 x 80 GiB), and llama3_8b full fine-tuning (bf16, 8 ranks x 2 x 4096
   tokens, full AC) with and without chunked cross-entropy, on 8 x 80 GiB.
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

RESULT = ROOT / "benchmarks" / "results" / "memory_cpu.txt"
LORA = ["--lora.rank=16", "--lora.alpha=32", "--lora.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"]
VARIANTS: dict[str, list[str]] = {
    "full": [],
    "full-bf16-state": ["--train.optimizer_state_dtype=bf16"],
    "full-int8-state": ["--train.optimizer_state_dtype=int8"],
    # 4x the tokens per micro-batch (2048: (2048, 16384) fp32 logits are 128 MiB), so the logits matter
    "mb8-unchunked": ["--train.micro_batch_size=8", "--train.loss_chunk_tokens=0"],
    "mb8-chunked": ["--train.micro_batch_size=8", "--train.loss_chunk_tokens=256"],
    "lora": LORA,
    "lora-bf16-base": [*LORA, "--lora.base_dtype=bf16"],
    "qlora": [*LORA, "--lora.base_dtype=nf4"],
}
PLANS: dict[str, list[str]] = {
    "llama3_70b QLoRA (nf4 base), 1 node x 8 x 80 GiB": [
        "--config", "configs/llama3_70b_lora.toml", "--lora.base_dtype=nf4", "--parallel.dp_replicate=1",
        "--parallel.dp_shard=-1", "--nodes", "1"],
    "llama3_70b LoRA (bf16 base), 1 node x 8 x 80 GiB": [
        "--config", "configs/llama3_70b_lora.toml", "--lora.base_dtype=bf16", "--parallel.dp_replicate=1",
        "--parallel.dp_shard=-1", "--nodes", "1"],
    "llama3_8b full FT, chunked CE (4096)": [
        "--model.preset=llama3_8b", "--train.mixed_precision=bf16", "--train.micro_batch_size=2",
        "--data.seq_len=4096", "--train.ac=full", "--train.loss_chunk_tokens=4096", "--nodes", "1"],
    "llama3_8b full FT, unchunked CE": [
        "--model.preset=llama3_8b", "--train.mixed_precision=bf16", "--train.micro_batch_size=2",
        "--data.seq_len=4096", "--train.ac=full", "--train.loss_chunk_tokens=0", "--nodes", "1"],
}


def write_assets(d: Path) -> None:
    """The HF model (fp32 safetensors), the demo tokenizer, SFT pairs."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from shardlm.assets.debug_hf import make_tokenizer, sft_pairs

    model_dir = d / "model"
    model_dir.mkdir(parents=True)
    make_tokenizer(model_dir)
    eos = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id("<|endoftext|>")
    cfg = transformers.LlamaConfig(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                   intermediate_size=1536, vocab_size=16384, max_position_embeddings=1024,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=eos, bos_token_id=eos)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(model_dir, safe_serialization=True)
    (d / "sft.jsonl").write_text("".join(json.dumps(p) + "\n" for p in sft_pairs(1500)))


def train(d: Path, name: str, extra: list[str], steps: int, rnd: int) -> dict:
    """One variant under torchrun: {'peak_gib', 'tok_s', 'loss'} or {'skipped': line}."""
    out = d / f"run-{name}-{rnd}"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "shardlm",
            "train", f"--model.init_from=hf:{d / 'model'}", "--data.format=sft", f"--data.path={d / 'sft.jsonl'}",
            f"--data.cache_dir={d / 'cache'}", "--data.seq_len=256", "--train.micro_batch_size=2",
            "--train.mixed_precision=fp32", "--train.device=cpu", f"--train.steps={steps + 2}",
            "--train.warmup_steps=2", "--train.lr=1e-4", f"--train.output_dir={out}", "--metrics.log_every=1",
            "--metrics.progress_bar=false", "--checkpoint.save_final=false", "--checkpoint.interval=0",
            f"--checkpoint.dir={out / 'ckpt'}", "--train.sample_tokens=0", "--eval.at_end=false", *extra]
    r = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
    if r.returncode:
        err = [ln for ln in r.stderr.splitlines() if "shardlm: error" in ln or "Error" in ln]
        return {"skipped": (err[0] if err else r.stderr.strip().splitlines()[-1])[:200]}
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [x for x in recs if "loss" in x]
    return {"peak_gib": recs[-1]["mem_gib"], "tok_s": statistics.median(x["tokens_per_sec"] for x in recs[2:]),
            "loss": recs[-1]["loss"]}


def planned(d: Path, extra: list[str]) -> dict:
    """The planner's per-rank peak and model state for a variant as it ran here (2 ranks, fp32, CPU: every block
    but the last resharded), from FSDPMemTracker's view: tensors only, no library or allocator overhead."""
    r = subprocess.run([sys.executable, "-m", "shardlm", "plan", "--gpu-mem-gib", "80", "--gpus-per-node", "2",
                        "--nodes", "1", "--json", "--no-alternatives", f"--model.init_from=hf:{d / 'model'}",
                        "--data.seq_len=256", "--train.micro_batch_size=2", "--train.mixed_precision=fp32",
                        "--parallel.reshard_after_forward=true", *extra], capture_output=True, text=True, cwd=ROOT)
    if r.returncode not in (0, 3):
        return {}
    b = json.loads(r.stdout)["base"]
    return {"peak": b["peak"]["total"], "state": b["model_state"]["total"]}


def import_rss() -> tuple[float, float]:
    """Peak RSS (MiB) of a process that imports torch + the trainer, and of one that also imports torchao's
    NF4 and optimizer modules (what int8 state and nf4 bases load): the part of a run's RSS that is code."""
    code = "import resource, {}; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    base = "torch, shardlm.train.trainer"
    ao = base + ", torchao.optim, torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
    return tuple(int(subprocess.run([sys.executable, "-c", code.format(m)], capture_output=True, text=True,
                                    cwd=ROOT).stdout.split()[-1]) / 1024 for m in (base, ao))


def plan(extra: list[str]) -> str:
    r = subprocess.run([sys.executable, "-m", "shardlm", "plan", "--gpu-mem-gib", "80", "--gpus-per-node", "8",
                        "--json", "--no-alternatives", *extra], capture_output=True, text=True, cwd=ROOT)
    if r.returncode not in (0, 3):
        err = [ln for ln in r.stderr.splitlines() if ln.strip()]
        return f"not planned: {err[-1] if err else r.returncode}"
    rep = json.loads(r.stdout)
    b = rep["base"]
    st, pk = b["model_state"], b["peak"]
    return (f"peak {rep['peak_gib']:.2f} GiB/rank ({'FITS' if r.returncode == 0 else 'does NOT fit'} in 80 GiB less "
            f"headroom); model state {st['total'] / 2**30:.2f} GiB (params {st['params'] / 2**30:.2f}, optimizer "
            f"{st['optimizer'] / 2**30:.2f}); at the peak: activations {pk['activations'] / 2**30:.2f}, temporaries "
            f"{pk['temporaries'] / 2**30:.2f} GiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="measured steps per variant, after 2 untimed (default 6)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each variant, order reversed each round")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--save", action="store_true", help=f"write {RESULT.relative_to(ROOT)}")
    a = ap.parse_args()
    names = [n for n in VARIANTS if not a.only or n in a.only.split(",")]
    rows: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="shardlm-memory-bench-") as tmp:
        d = Path(tmp)
        write_assets(d)
        for rnd in range(a.rounds):
            for n in names if rnd % 2 == 0 else names[::-1]:
                rows[n].append(train(d, n, VARIANTS[n], a.steps, rnd))
                print(f"  [{rnd + 1}/{a.rounds}] {n}: {rows[n][-1]}", flush=True)
        plans = {n: planned(d, VARIANTS[n]) for n in names}
        print(f"  planned: {plans}", flush=True)
    code_rss = import_rss()
    lines = [f"memory features, CPU, 2 gloo ranks, HF Llama 29.2M (hidden 512, 4 blocks, vocab 16384), fp32 compute, "
             f"2x256 tokens per rank and step (mb8-*: 8x256), {a.steps} measured steps, medians of {a.rounds} round(s)",
             f"{'variant':<17} {'peak RSS rank 0':>16} {'vs full':>9} {'tokens/s':>9} {'last loss':>10} "
             f"{'planned peak':>13} {'model state':>12}"]
    full = None
    for n in names:
        ok = [r for r in rows[n] if "skipped" in r] == []
        if not ok:
            lines.append(f"{n:<17} skipped: {rows[n][0]['skipped']}")
            continue
        peak = statistics.median(r["peak_gib"] for r in rows[n]) * 1024
        tps = statistics.median(r["tok_s"] for r in rows[n])
        full = peak if n == "full" else full
        vs = f"{peak - full:+8.0f}" if full is not None else ""
        pl = plans.get(n) or {}
        pcol = f"{pl['peak'] / 2**20:9.0f} MiB {pl['state'] / 2**20:8.0f} MiB" if pl else f"{'(not planned)':>25}"
        lines.append(f"{n:<17} {peak:12.0f} MiB {vs:>9} {tps:9,.0f} {rows[n][-1]['loss']:10.4f} {pcol}")
    lines += [f"(peak RSS = ru_maxrss of rank 0: code included; importing torch + the trainer peaks at {code_rss[0]:.0f} "
              f"MiB, with torchao's NF4 and optimizer modules {code_rss[1]:.0f} MiB. Planned = shardlm plan of the same "
              "config on 2 ranks: the tensors' per-rank peak and model state as FSDPMemTracker counts them)",
              "", "planner (shardlm plan, fake tensors, 8 x 80 GiB):"]
    lines += [f"  {k}: {plan(v)}" for k, v in PLANS.items()]
    report(lines, RESULT if a.save else None)


if __name__ == "__main__":
    main()
