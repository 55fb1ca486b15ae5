"""Mixtures of experts: which GPUs each preset needs (planned), and what a tiny MoE costs on a CPU.

    python benchmarks/moe.py [--part plan|cpu|gpu|both] [--save]

(1) plan: `shardlm plan` (offline, fake tensors) of each MoE preset, a full fine-tune, LoRA r16 (attention and every
    expert) and QLoRA r16 (lora.base_dtype=nf4: the attention linears and every expert projection in NF4), bf16, full
    AC, micro-batch 1 x 4096 tokens, chunked loss (4096), no alternatives: the smallest count of 80 GiB GPUs (8 per
    node, doubling from 8) at which the plan fits, and its per-GPU total (`= on the GPU`).
(2) cpu: tokens/s of a training step (forward + backward, fp32, one process, 2 cores) of the debug_moe model (8
    experts, top-2) and of the dense model of the same active size (the same blocks with a SwiGLU of top_k x
    moe_ffn_dim = 96: equal active parameters but for the router), 8 x 128 tokens. Five interleaved rounds of 10
    timed steps after 3 warm-up steps; the median per model and the ratio.
(3) gpu (when a GPU is lent): one MoE layer of Qwen3-30B-A3B's shape in bf16 on 16k tokens, forward + backward,
    with the grouped matmul (F.grouped_mm) and with the per-expert loop: the same loss (rel 1e-2, bf16) and the
    tokens/s of each; then the same with the experts in NF4 as QLoRA holds them (torchao needed).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "moe.txt"
GIB = 2**30
PRESETS = ("qwen3_30b_a3b", "mixtral_8x7b", "mixtral_8x22b", "qwen3_235b_a22b")
MODES = {"full": [], "LoRA r16": ["--lora.rank=16", "--lora.alpha=32"],
         "QLoRA r16": ["--lora.rank=16", "--lora.alpha=32", "--lora.base_dtype=nf4"]}
PLAN_ARGS = ["--train.micro_batch_size=1", "--data.seq_len=4096", "--train.mixed_precision=bf16", "--train.ac=full",
             "--train.loss_chunk_tokens=4096", "--train.grad_accum=1"]


def plan_rows(max_gpus: int = 256) -> list[str]:
    from shardlm.build import build_model_config, model_state_bytes
    from shardlm.config import load_config
    from shardlm.plan import plan

    lines = [f"{'model':<17} {'trains':<10} {'GPUs':>5} {'per GPU (GiB)':>14}  (smallest 8 x 2^n that fits; "
             "peak at half that count)"]
    for preset in PRESETS:
        for mode, extra in MODES.items():
            cfg = load_config(None, [f"--model.preset={preset}", *PLAN_ARGS, *extra])
            # start where the sharded model state alone fits (weights, grads, AdamW): the plans below cannot fit
            state = model_state_bytes(cfg, build_model_config(cfg, 0))
            world, fit, below = 8, None, None
            while world * 80 * 0.9 * GIB < state:
                world *= 2
            while world <= max_gpus:
                t0 = time.perf_counter()
                r = plan(cfg, world, 80, 8, alternatives=False)
                print(f"  {preset} {mode} {world} GPUs: {r.base.peak_bytes / GIB:.1f} GiB "
                      f"({time.perf_counter() - t0:.0f}s)", flush=True)
                if r.fits:
                    fit = (world, r.base.peak_bytes / GIB)
                    break
                below = (world, r.base.peak_bytes / GIB)
                world *= 2
            cell = f"{fit[0]:>5} {fit[1]:>14.1f}" if fit else f"{'>' + str(max_gpus):>5} {'-':>14}"
            more = f"  ({below[0]} GPUs: {below[1]:.1f})" if below else ""
            lines.append(f"{preset:<17} {mode:<10} {cell}{more}")
    return lines


def _step_time(model, x, y, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        model(x, labels=y).backward()
    return time.perf_counter() - t0


def cpu_rows(rounds: int = 5, steps: int = 10) -> list[str]:
    from shardlm.models import Transformer
    from shardlm.models.presets import PRESETS as ALL

    torch.manual_seed(0)
    moe = dataclasses.replace(ALL["debug_moe"], max_seq_len=128)
    dense = dataclasses.replace(moe, n_experts=0, ffn_dim=moe.n_experts_per_tok * moe.moe_ffn_dim)
    models = {}
    for name, mc in (("debug_moe", moe), ("dense, same active", dense)):
        m = Transformer(mc)
        m.init_weights(0)
        models[name] = (m, mc)
    x = torch.randint(0, moe.vocab_size, (8, 128))
    y = torch.roll(x, -1, 1)
    for m, _ in models.values():
        _step_time(m, x, y, 3)
    seen = {n: [] for n in models}
    for _ in range(rounds):
        for name, (m, _) in models.items():
            seen[name].append(x.numel() * steps / _step_time(m, x, y, steps))
    base = statistics.median(seen["dense, same active"])
    lines = [f"forward + backward, fp32, one process ({torch.get_num_threads()} threads), 8 x 128 tokens; median "
             f"tokens/s of {rounds} interleaved rounds of {steps} steps"]
    for name, (m, mc) in models.items():
        med = statistics.median(seen[name])
        lines.append(f"  {name:<19} {mc.num_params() / 1e6:.2f}M params, {mc.num_params(active=True) / 1e6:.2f}M "
                     f"active: {med:>7.0f} tokens/s  {med / base:.2f}x   rounds: " + ", ".join(f"{v:.0f}" for v in seen[name]))
    return lines


def _quantize_experts(layer) -> None:
    """The layer's stacked expert projections as QLoRA holds them: one flat NF4 tensor each (`apply_nf4`'s layout)."""
    from torch import nn

    from shardlm.quant.nf4 import quantize_shard

    ex = layer.experts
    for p in ("gate_proj", "up_proj", "down_proj"):
        w = getattr(ex, p)
        ex.logical_shapes[p] = tuple(w.shape)
        setattr(ex, p, nn.Parameter(quantize_shard(w.detach().reshape(-1, w.shape[-1])), requires_grad=False))


def _time_paths(layer, x, steps: int, sync) -> tuple[dict, dict]:
    """(seconds, last loss) of forward + backward with the grouped kernel and with the per-expert loop."""
    from shardlm.models import moe as moe_mod

    out, times = {}, {}
    grouped = moe_mod.use_grouped_mm
    for name, use in (("grouped_mm", grouped), ("per-expert loop", lambda _x: False)):
        moe_mod.use_grouped_mm = use
        try:
            for _ in range(2):
                layer(x).float().pow(2).mean().backward()
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = layer(x).float().pow(2).mean()
                loss.backward()
            sync()
            times[name], out[name] = time.perf_counter() - t0, loss.item()
        except Exception as e:  # noqa: BLE001 (report the failing path, keep the other)
            times[name], out[name] = None, f"{type(e).__name__}: {e}"
        finally:
            moe_mod.use_grouped_mm = grouped
    return times, out


def gpu_rows(tokens: int = 16384, steps: int = 10) -> list[str]:
    from shardlm.models import moe as moe_mod
    from shardlm.models.presets import PRESETS as ALL

    if not torch.cuda.is_available():
        return ["no CUDA GPU: skipped"]
    mc = ALL["qwen3_30b_a3b"]
    torch.manual_seed(0)
    layer = moe_mod.MoE(mc.dim, mc.n_experts, mc.n_experts_per_tok, mc.moe_ffn_dim, True).cuda().bfloat16()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(tokens, mc.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    lines = [f"{torch.cuda.get_device_name()}: one Qwen3-30B-A3B MoE layer (128 experts, top-8), bf16, {tokens} tokens, "
             f"forward + backward, {steps} steps; grouped_mm available: {moe_mod.use_grouped_mm(x)}"]
    kinds = [("bf16 experts", None)]
    try:
        import torchao  # noqa: F401 (QLoRA's NF4 experts need it)

        kinds.append(("NF4 experts (QLoRA)", _quantize_experts))
    except ImportError:
        lines.append("  (no torchao: the NF4 experts' rows are skipped)")
    for kind, prepare in kinds:
        if prepare is not None:
            prepare(layer)
        times, out = _time_paths(layer, x, steps, torch.cuda.synchronize)
        for name, t in times.items():
            lines.append(f"  {kind:<20} {name:<16} loss {out[name]}  "
                         + (f"{tokens * steps / t:,.0f} tokens/s" if t else "failed"))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("plan", "cpu", "gpu", "both"), default="both")
    ap.add_argument("--save", action="store_true", help=f"write the report to {RESULT.relative_to(ROOT)}")
    args = ap.parse_args()
    lines = ["mixtures of experts: planned GPUs per preset, and the CPU cost of routing", ""]
    if args.part in ("plan", "both"):
        lines += ["(1) `shardlm plan` per GPU (80 GiB, 10% headroom), bf16, full AC, 1 x 4096 tokens, chunked loss:",
                  *plan_rows(), ""]
    if args.part in ("cpu", "both"):
        lines += ["(2) CPU throughput, MoE vs the dense model of the same active size:", *cpu_rows(), ""]
    if args.part == "gpu":
        lines += ["(3) grouped matmul vs the per-expert loop:", *gpu_rows(), ""]
    text = "\n".join(lines)
    print(text)
    if args.save:
        RESULT.write_text(text + "\n")


if __name__ == "__main__":
    main()
