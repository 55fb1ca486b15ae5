"""`shardlm plan` against the per-GPU memory the anchors measured on real GPUs, for the configurations they state.

    python benchmarks/plan_vs_published.py [--only ID,ID] [--save]

Each row is one published measurement (torchtitan's benchmarks/*.md, pytorch/ao's training docs, torchtune's
README tables, NeMo AutoModel's guide), the configuration it states written as shardlm keys, the published figure
and what it is, shardlm's planned figure of the same quantity, and their ratio:

* reserved: `torch.cuda.max_memory_reserved()` (torchtitan's and torchao's tables, under expandable segments):
  planned = the replayed caching allocator's peak (`shardlm.plan.allocator`): the tensors, the cuBLAS workspaces
  and the allocator's gaps;
* active / allocated: torchtune's "Peak Memory Active", NeMo's `max_memory_allocated()`: planned = the tensors'
  peak + the cuBLAS workspaces (what the allocator hands out);
* unstated (torchtune's Llama 3.1 table prints "Peak Memory per GPU"): compared with the allocated figure, the
  smaller of the two readings, and said so.

A row is "within" at 0.90-1.05x. Any other row carries the line that explains it: a tensor shardlm holds and the
anchor does not (and why), or a setting shardlm does not model or have. torch.compile is not modelled (the planner
plans eager memory: compiled rows are compared with the eager plan and marked). Rows that need a parallelism
shardlm has not got yet (context parallelism) are listed, not planned. Every source path and configuration was
read from the anchors' repositories (commits in the rows); the sizes are the GPUs' (an H100 96 GB shows 95.0 GiB
in torchtitan's logs, an 80 GB GPU 80 GiB).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, report  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "plan_vs_published.txt"
BAND = (0.90, 1.05)

TT8B = ["--model.preset=llama3_8b", "--train.mixed_precision=bf16", "--data.seq_len=8192",
        "--parallel.reshard_after_forward=true", "--train.loss_chunk_tokens=0"]  # torchtitan: last block kept
SAC = ["--train.ac=selective_op"]
FP8 = ["--train.mixed_precision=fp8", "--train.fp8_recipe=tensorwise"]
TT_PLAIN_CE = "plain CE on fp32 logits as torchtitan's loss (train.loss_chunk_tokens=0)"
# torchtune trains in pure bf16 (no MixedPrecisionPolicy): its reduce-scatters run in bf16, its AdamW moments are bf16
TUNE = ["--train.mixed_precision=bf16", "--parallel.reshard_after_forward=true", "--train.ac=full",
        "--train.reduce_dtype=bf16"]
LLAMA3_3B = ["--model.preset=llama3_3b", "--train.mixed_precision=bf16", "--data.seq_len=4096",
             "--train.micro_batch_size=2", "--parallel.reshard_after_forward=true", "--train.reduce_dtype=bf16"]
BF16_MOMENTS = "--train.optimizer_state_dtype=bf16"
ALL7 = "--lora.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"

TITAN_2412 = "pytorch/torchtitan:benchmarks/llama3_h100_202412_torchtitan.md"
AO_H100 = "pytorch/ao:docs/source/workflows/training.md (H100)"
TUNE_README = "pytorch/torchtune:README.md@30b8519e (Memory and training speed)"
TUNE_LADDER = "pytorch/torchtune:README.md@1814feb1 (Optimization flags, Llama 3.2 3B, A100)"


PURE_BF16 = ("torchtune trains in pure bf16: bf16 weights and gradients; shardlm keeps fp32 master weights and "
             "fp32 gradients (an update of lr x g below a bf16 weight's resolution, 2^-8 of it, would be lost): "
             "{master:.1f} GiB more for {params:.2f}B parameters; less that, the plan is {less:.2f} GiB, {less_ratio:.2f}x")
OFFLOADED_INPUTS = ("torchtune offloads the checkpointed block inputs to host memory (enable_activation_offloading; "
                    "shardlm keeps them on the GPU: {ckpt:.2f} GiB here) and trains the adapters in bf16 (shardlm: fp32 "
                    "adapters and moments, {adapters:.2f} GiB more); less those, the plan is {less:.2f} GiB, "
                    "{less_ratio:.2f}x")
COMPILED_LOSS = ("torch.compile of the blocks and, since torchtitan bbb1b616 (2025-04-02), of the loss: not modelled "
                 "(eager planned). The same toml measured 47.65 GiB in March 2025 (A11: blocks compiled, loss eager, "
                 "within the band of this plan) and 30.89 in June (N4): what inductor keeps of the loss and the "
                 "blocks then is not a setting shardlm has (train.compile compiles the blocks only)")
NEMO_GC = "NVIDIA-NeMo/Automodel:docs/guides/gradient-checkpointing.mdx (PyTorch 2.8)"
NEMO_1B = ["--model.preset=llama3_1b", "--train.mixed_precision=bf16", "--data.seq_len=2048", "--train.micro_batch_size=8"]
NEMO_UNITS = ("measured on transformers' LlamaForCausalLM, whose loss upcasts the whole logits and returns them (not "
              "shardlm's model); the table's unit is \"GB\" and its precision unstated: read as 10^9 B the figure is "
              "{published_gib:.2f} GiB ({gb_ratio:.2f}x); a bf16 model state is planned")
COMPILED_TEMPS = ("torch.compile is not modelled: the anchor compiled every block, fusing the elementwise ops whose "
                  "outputs the eager recomputation holds (temporaries at the planned peak: {temps:.2f} GiB)")


@dataclass
class Row:
    id: str
    source: str
    what: str
    published: float  # GiB (the torchao docs print "GB" for torchtitan's GiB reading)
    quantity: str  # reserved | active | allocated | unstated
    overrides: list[str]
    ranks: int = 8
    gpus_per_node: int = 8
    gpu_mem_gib: float = 95.0
    compiled: bool = False  # the anchor ran torch.compile (not modelled: the eager plan is compared)
    why: str = ""  # when the ratio is outside the band: what explains it
    plannable: str = ""  # non-empty: not planned, and why
    planned: float | None = field(default=None, init=False)


ROWS = [
    Row("A1", f"{TITAN_2412} Table 1 (torchtitan 9dec370)", "Llama 3.1 8B, 8 x H100 96GB, FSDP 8, seq 8192, mbs 2, "
        "per-op SAC, bf16, eager", 82.4, "reserved", [*TT8B, *SAC, "--train.micro_batch_size=2"]),
    Row("A2", f"{TITAN_2412} Table 1", "A1 + torch.compile", 77.0, "reserved",
        [*TT8B, *SAC, "--train.micro_batch_size=2"], compiled=True),
    Row("A3", f"{TITAN_2412} Table 1", "A1 + Float8 (tensorwise) + torch.compile", 76.8, "reserved",
        [*TT8B, *SAC, *FP8, "--train.micro_batch_size=2"], compiled=True),
    Row("A4", f"{TITAN_2412} Table 3", "A1 on 128 x H100 (FSDP 128)", 67.0, "reserved",
        [*TT8B, *SAC, "--train.micro_batch_size=2"], ranks=128),
    Row("A5", f"{TITAN_2412} Table 3", "A4 + torch.compile", 62.0, "reserved",
        [*TT8B, *SAC, "--train.micro_batch_size=2"], ranks=128, compiled=True),
    Row("A6", f"{TITAN_2412} Table 3", "A4 + Float8 + torch.compile", 61.8, "reserved",
        [*TT8B, *SAC, *FP8, "--train.micro_batch_size=2"], ranks=128, compiled=True),
    Row("A7", f"{TITAN_2412} Table 2", "Llama 3.1 8B, 8 x H100, FSDP 8, seq 32768, mbs 1, full AC, Float8 + compile",
        83.9, "reserved", [*TT8B, *FP8, "--data.seq_len=32768", "--train.micro_batch_size=1", "--train.ac=full"],
        compiled=True),
    # torchtitan's CP is ring attention (load-balanced); shardlm's is Ulysses: the same tokens per rank, so the same
    # activations per rank; attention's own buffers differ (ring: K/V of one peer at a time; Ulysses: the whole
    # sequence for heads / cp heads), both O(tokens per rank) with flash
    Row("A8", f"{TITAN_2412} Table 2", "FSDP 4 x CP 2, seq 65536, full AC, Float8 + compile", 84.2, "reserved",
        [*TT8B, *FP8, "--data.seq_len=65536", "--train.micro_batch_size=1", "--train.ac=full", "--parallel.cp=2"],
        compiled=True),
    Row("A9", f"{TITAN_2412} Table 2", "FSDP 2 x CP 4, seq 131072", 84.0, "reserved",
        [*TT8B, *FP8, "--data.seq_len=131072", "--train.micro_batch_size=1", "--train.ac=full", "--parallel.cp=4"],
        compiled=True),
    Row("A10", f"{TITAN_2412} Table 2", "FSDP 1 x CP 8, seq 262144", 84.5, "reserved",
        [*TT8B, *FP8, "--data.seq_len=262144", "--train.micro_batch_size=1", "--train.ac=full", "--parallel.cp=8"],
        compiled=True),
    Row("A11", f"{AO_H100} (torchtitan 0.0.2)", "Llama 3 8B, 8 x H100, FSDP 8, seq 8192, mbs 1, per-op SAC, bf16 + "
        "compile", 47.65, "reserved", [*TT8B, *SAC, "--train.micro_batch_size=1"], compiled=True),
    Row("A12", AO_H100, "A11 with Float8 tensorwise + float8 all-gather", 47.77, "reserved",
        [*TT8B, *SAC, *FP8, "--train.micro_batch_size=1"], compiled=True),
    Row("A13", AO_H100, "A11 with Float8 rowwise", 47.79, "reserved",
        [*TT8B, *SAC, "--train.mixed_precision=fp8", "--train.fp8_recipe=rowwise", "--train.micro_batch_size=1"],
        compiled=True),
    Row("N3a", "pytorch/torchtitan commit e23bb707 (message: logs of 2025-03-20)", "Llama 3 8B, H100 96GB, seq 8192, "
        "mbs 1, per-op SAC, plain CE (ranks unstated: 8 planned)", 49.58, "reserved",
        [*TT8B, *SAC, "--train.micro_batch_size=1"]),
    Row("N3b", "pytorch/torchtitan commit e23bb707", "N3a with chunked CE (8 chunks)", 42.26, "reserved",
        [*TT8B, *SAC, "--train.micro_batch_size=1", "--train.loss_chunk_tokens=1024"],
        why="shardlm holds less: torchtitan's chunked CE (e23bb707) computes the whole (8192, 128256) bf16 logits and "
            "then the loss chunk by chunk, keeping the logits (1.96 GiB) and every chunk's fp32 log-probabilities for "
            "backward (3.92 GiB); shardlm's runs the head and the loss per chunk under checkpointing and keeps "
            "neither (train.loss_chunk_tokens)"),
    Row("N4", "pytorch/ao:docs/source/eager_tutorials/pretraining.rst (logs of 2025-06-04, torchtitan 775a486)",
        "Llama 3 8B, 8 x H100 96GB, FSDP 8, seq 8192, mbs 1, per-op SAC, bf16 + compile (model and loss)", 30.89,
        "reserved", [*TT8B, *SAC, "--train.micro_batch_size=1", "--train.loss_chunk_tokens=4096"], compiled=True,
        why=COMPILED_LOSS),
    Row("A14", "pytorch/ao:docs/source/workflows/training.md (B200; torchtitan 6fc499f)", "Llama 3 8B, 8 x B200, FSDP 8, "
        "seq 8192, mbs 1, per-op SAC, bf16 + compile (loss compiled)", 33.71, "reserved",
        [*TT8B, *SAC, "--train.micro_batch_size=1", "--train.loss_chunk_tokens=4096"], gpu_mem_gib=178.0,
        compiled=True, why=COMPILED_LOSS),
    Row("A20", "pytorch/torchtitan:torchtitan/components/quantization/nvfp4.md", "Llama 3 8B, 4 x SM100 (~184 GiB), "
        "FSDP 4, seq 2048, mbs 32, SAC, bf16 + compile", 174.49, "reserved",
        [*TT8B, *SAC, "--data.seq_len=2048", "--train.micro_batch_size=32", "--train.loss_chunk_tokens=4096"],
        ranks=4, gpus_per_node=4, gpu_mem_gib=184.0, compiled=True),
    Row("C8", f"{TUNE_README} + recipes/configs/llama3_1/70B_lora.yaml", "Llama 3.1 70B LoRA r16 a32 on q,k,v, "
        "8 x A100 80GB, packed 2048, bs 2, full AC, chunked CE (8), compile", 27.6, "unstated",
        ["--model.preset=llama3_70b", *TUNE, "--lora.rank=16", "--lora.alpha=32", "--lora.targets=q_proj,k_proj,v_proj",
         "--lora.base_dtype=bf16", "--data.seq_len=2048", "--train.micro_batch_size=2", "--train.loss_chunk_tokens=512"],
        gpu_mem_gib=80.0, compiled=True),
    Row("N8", f"{TUNE_README} + llama3_1/8B_lora_single_device.yaml", "Llama 3.1 8B LoRA r8 a16 on q,v, 1 x RTX 4090, "
        "packed 2048, bs 2, full AC, chunked CE (8), compile", 16.2, "unstated",
        ["--model.preset=llama3_8b", *TUNE, "--lora.rank=8", "--lora.alpha=16", "--lora.targets=q_proj,v_proj",
         "--lora.base_dtype=bf16", "--data.seq_len=2048", "--train.micro_batch_size=2", "--train.loss_chunk_tokens=512"],
        ranks=1, gpus_per_node=1, gpu_mem_gib=24.0, compiled=True, why=COMPILED_TEMPS),
    Row("N9", f"{TUNE_README}", "N8 on 1 x RTX A6000", 30.3, "unstated",
        ["--model.preset=llama3_8b", *TUNE, "--lora.rank=8", "--lora.alpha=16", "--lora.targets=q_proj,v_proj",
         "--lora.base_dtype=bf16", "--data.seq_len=2048", "--train.micro_batch_size=2", "--train.loss_chunk_tokens=512"],
        ranks=1, gpus_per_node=1, gpu_mem_gib=48.0, compiled=True,
        why="the same configuration as N8 measured 16.2 GiB on a 24 GiB GPU and 30.3 on a 48 GiB one: the figure "
            "depends on the GPU's size, so it is not the tensors' peak (an allocator's cache, or a reading that "
            "is not the peak); N8 is the comparable one"),
    Row("N10", f"{TUNE_README} + llama3_1/8B_qlora_single_device.yaml", "Llama 3.1 8B QLoRA r8 a16 on q,k,v,o + MLP, "
        "1 x RTX 4090, packed 2048, bs 2, full AC, chunked CE (8), compile", 7.4, "unstated",
        ["--model.preset=llama3_8b", *TUNE, "--lora.rank=8", "--lora.alpha=16", ALL7, "--lora.base_dtype=nf4",
         "--data.seq_len=2048", "--train.micro_batch_size=2", "--train.loss_chunk_tokens=512"],
        ranks=1, gpus_per_node=1, gpu_mem_gib=24.0, compiled=True,
        why=COMPILED_TEMPS + "; under QLoRA they include each NF4 weight dequantised to bf16 for its matmul"),
    Row("N11", f"{TUNE_README} + llama3_1/70B_full.yaml", "Llama 3.1 70B full fine-tune, 8 x A100, CPU offload, "
        "packed 2048, bs 2, full AC, chunked CE (8), pure bf16", 13.9, "unstated",
        ["--model.preset=llama3_70b", *TUNE, "--train.cpu_offload=true", "--data.seq_len=2048",
         "--train.micro_batch_size=2", "--train.loss_chunk_tokens=512"], gpu_mem_gib=80.0, compiled=True,
        why=COMPILED_TEMPS + "; the figure is what stays on the GPU under CPU offload (planned: the peak less the "
            "sharded weights, gradients and moments, which FSDP keeps in host memory)"),
    Row("C10-1", TUNE_LADDER, "Llama 3.2 3B full, bs 2 x 4096 packed, no AC, plain CE on fp32 logits, pure bf16, "
        "eager", 60.0, "active", [*LLAMA3_3B, BF16_MOMENTS, "--train.ac=none", "--train.loss_chunk_tokens=0"], ranks=1,
        gpus_per_node=1, gpu_mem_gib=80.0, why=PURE_BF16),
    Row("C10-2", TUNE_LADDER, "C10-1 + compile", 51.0, "active",
        [*LLAMA3_3B, BF16_MOMENTS, "--train.ac=none", "--train.loss_chunk_tokens=0"], ranks=1, gpus_per_node=1,
        gpu_mem_gib=80.0, compiled=True, why=PURE_BF16),
    Row("C10-3", TUNE_LADDER, "C10-2 + chunked CE (8 chunks)", 42.9, "active",
        [*LLAMA3_3B, BF16_MOMENTS, "--train.ac=none", "--train.loss_chunk_tokens=1024"], ranks=1, gpus_per_node=1,
        gpu_mem_gib=80.0, compiled=True, why=PURE_BF16),
    Row("C10-4", TUNE_LADDER, "C10-3 + full AC", 24.9, "active",
        [*LLAMA3_3B, BF16_MOMENTS, "--train.ac=full", "--train.loss_chunk_tokens=1024"], ranks=1, gpus_per_node=1,
        gpu_mem_gib=80.0, compiled=True, why=PURE_BF16),
    Row("C10-7", TUNE_LADDER, "C10-4 + optimizer in backward + activation offload + 8-bit AdamW", 17.6, "active",
        [*LLAMA3_3B, "--train.ac=full", "--train.loss_chunk_tokens=1024", "--train.optimizer_state_dtype=int8"],
        ranks=1, gpus_per_node=1, gpu_mem_gib=80.0, compiled=True,
        why="torchtune's optimizer step runs inside backward (optimizer_in_bwd: no gradient is kept past its "
            "parameter's update) and its block inputs are offloaded to host memory; shardlm keeps fp32 master "
            "weights ({master:.1f} GiB more than bf16 ones) and the sharded gradients until the step, and its "
            "checkpointed block inputs ({ckpt:.2f} GiB) on the GPU: none of the three is in shardlm yet"),
    Row("C10-L", TUNE_LADDER, "Llama 3.2 3B LoRA r64 a128 on q,v,o + MLP, packed, compile, chunked CE, full AC, "
        "activation offload", 8.5, "active",
        [*LLAMA3_3B, "--train.ac=full", "--train.loss_chunk_tokens=1024", "--lora.rank=64", "--lora.alpha=128",
         "--lora.targets=q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "--lora.base_dtype=bf16"], ranks=1,
        gpus_per_node=1, gpu_mem_gib=80.0, compiled=True, why=OFFLOADED_INPUTS),
    Row("C10-Q", TUNE_LADDER, "C10-L with an NF4 base (QLoRA)", 4.6, "active",
        [*LLAMA3_3B, "--train.ac=full", "--train.loss_chunk_tokens=1024", "--lora.rank=64", "--lora.alpha=128",
         "--lora.targets=q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "--lora.base_dtype=nf4"], ranks=1,
        gpus_per_node=1, gpu_mem_gib=80.0, compiled=True, why=OFFLOADED_INPUTS),
    Row("N13a", NEMO_GC, "Llama 3.2 1B, 8 x H100 80GB, FSDP 8, local bs 8 x 2048, no AC, plain CE (precision unstated: "
        "bf16 planned)", 47.59, "allocated", [*NEMO_1B, "--train.ac=none", "--train.loss_chunk_tokens=0"],
        gpu_mem_gib=80.0, why=NEMO_UNITS),
    Row("N13b", NEMO_GC, "N13a + activation checkpointing", 33.06, "allocated",
        [*NEMO_1B, "--train.ac=full", "--train.loss_chunk_tokens=0"], gpu_mem_gib=80.0, why=NEMO_UNITS),
    Row("N13c", NEMO_GC, "N13b + linear-cut cross-entropy (no logits)", 7.30, "allocated",
        [*NEMO_1B, "--train.ac=full", "--train.loss_chunk_tokens=1024"], gpu_mem_gib=80.0, why=NEMO_UNITS),
]


# Unsloth's "maximum context length per GPU VRAM" (README@0acd1c7e, unsloth.ai/docs/basics/unsloth-benchmarks): QLoRA,
# rank 32 on q,k,v,o,gate,up,down, batch 1; sizes in GB of VRAM (planned as GiB). Their gradient checkpointing
# offloads the block inputs to host memory and their loss is Apple's cut cross-entropy.
UNSLOTH = {
    "llama3_8b": {8: 2972, 12: 21848, 16: 40724, 24: 78475, 40: 153977, 48: 191728, 80: 342733},
    "llama3_70b": {48: 12106, 80: 89389},
}
QLORA_MAX = ["--lora.rank=32", "--lora.alpha=32", ALL7, "--lora.base_dtype=nf4", "--train.micro_batch_size=1",
             "--train.ac=full", "--train.mixed_precision=bf16", "--data.seq_len=4096"]


def max_context_table() -> list[str]:
    """shardlm's --max data.seq_len beside Unsloth's published max context, per model and GPU size."""
    from shardlm.config import load_config
    from shardlm.plan import plan_max

    lines = ["", "Largest data.seq_len on ONE GPU, QLoRA r32 on every linear, batch 1, full AC (shardlm plan --max) "
             "beside Unsloth's published maximum context (offloaded checkpoints + cut cross-entropy):", "",
             f"{'model':<12} {'GPU':>6} {'shardlm':>10} {'Unsloth':>10} {'ratio':>6}"]
    for preset, table in UNSLOTH.items():
        rep = plan_max(load_config(None, [f"--model.preset={preset}", *QLORA_MAX]), "data.seq_len", 1,
                       [float(g) for g in table], gpus_per_node=1)
        for r in rep.rows:
            ours = "none" if r.value is None else f"{r.value:,}"
            theirs = table[int(r.gpu_mem_gib)]
            ratio = "-" if r.value is None else f"{r.value / theirs:.2f}"
            lines.append(f"{preset:<12} {r.gpu_mem_gib:>4g} G {ours:>10} {theirs:>10,} {ratio:>6}")
    lines += ["", "Why shardlm's context is shorter: the checkpointed block inputs stay on the GPU (n_layers x dim x 2 "
              "bytes per token: 256 KiB for 8B, 1.25 MiB for 70B) where Unsloth moves them to host memory; the "
              "loss holds a chunk of logits (train.loss_chunk_tokens=4096 x vocab: 2 GiB in fp32 at 128k, and up to "
              "4096 tokens the whole sequence is one chunk, hence the steep short end) where cut cross-entropy holds "
              "none; and the CUDA context, the cuBLAS workspaces and the bf16 embedding and head (2 GiB for 8B) are "
              "counted. Activation offload is not in shardlm yet."]
    return lines


def planned(row: Row) -> tuple[float, str, dict]:
    """(planned GiB of the row's quantity, the plan's one-line summary, the figures its explanation may quote)."""
    from shardlm.config import load_config
    from shardlm.plan import GIB, plan
    from shardlm.plan.fake_step import model_config

    cfg = load_config(None, row.overrides)
    r = plan(cfg, row.ranks, row.gpu_mem_gib, row.gpus_per_node, alternatives=False)
    d = r.base.offload_device if r.base.cpu_offload else r.base.device
    value = (d.reserved if row.quantity == "reserved" else d.tensors + d.cublas) / GIB
    raw, mc = r.base.peak.raw, model_config(cfg)[0]
    t = cfg.train
    ckpt = mc.n_layers * t.micro_batch_size * cfg.data.seq_len * mc.dim * 2 / GIB  # bf16 block inputs (full AC)
    # at the peak, what bf16 weights and gradients would save over fp32 ones (the trained parameters are fp32)
    master = 0.0 if cfg.lora.rank else (raw.get("Sharded Param", 0) + raw.get("Sharded Grad", 0)) / 2 / GIB
    adapters = r.trainable_params * 6 / GIB if cfg.lora.rank else 0.0  # fp32 weight + moments vs bf16: 6 B more
    less = value - (master if "bf16 weights" in row.why or "master" in row.why else ckpt + adapters)
    facts = {"master": master, "params": r.n_params / 1e9, "ckpt": ckpt, "adapters": adapters, "less": less,
             "less_ratio": less / row.published, "temps": raw.get("Temp", 0) / GIB,
             "published_gib": row.published * 1e9 / GIB, "gb_ratio": value / (row.published * 1e9 / GIB)}
    summary = f"tensors {d.tensors / GIB:.2f}, reserved {d.reserved / GIB:.2f}, on the GPU {d.total / GIB:.2f}"
    return value, summary, facts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated row ids")
    ap.add_argument("--save", action="store_true", help=f"write the report to {RESULT.relative_to(ROOT)}")
    ap.add_argument("--no-max", dest="max_table", action="store_false",
                    help="skip the max-context table (minutes: a search of fake steps per GPU size)")
    a = ap.parse_args()
    rows = [r for r in ROWS if not a.only or r.id in a.only.split(",")]
    t0 = time.perf_counter()
    lines = ["shardlm plan vs published GPU memory (per GPU; planned with `shardlm plan`, offline; ratio = planned / "
             "published)", "",
             f"{'id':<6} {'published':>10} {'quantity':<9} {'planned':>8} {'ratio':>6}  {'':<7} configuration", ""]
    notes, n_in, n_planned = [], 0, 0
    for row in rows:
        if row.plannable:
            lines.append(f"{row.id:<6} {row.published:>7.2f} GiB {row.quantity:<9} {'-':>8} {'-':>6}  {'n/a':<7} "
                         f"{row.what}")
            notes.append(f"{row.id}: not planned: {row.plannable}")
            continue
        value, summary, facts = planned(row)
        ratio = value / row.published
        n_planned += 1
        inside = BAND[0] <= ratio <= BAND[1]
        n_in += inside
        mark = "within" if inside else "outside"
        extra = " [compiled: eager planned]" if row.compiled else ""
        lines.append(f"{row.id:<6} {row.published:>7.2f} GiB {row.quantity:<9} {value:>8.2f} {ratio:>6.2f}  {mark:<7} "
                     f"{row.what}{extra}")
        if not inside:
            notes.append(f"{row.id}: {row.why.format(**facts) if row.why else 'NOT EXPLAINED'} (plan: {summary})")
    lines += ["", f"{n_in} of {n_planned} planned rows within {BAND[0]:.2f}-{BAND[1]:.2f}x; "
              f"{len(rows) - n_planned} not planned.", "", "Rows outside the band, and why:"]
    lines += [f"  {n}" for n in notes] or ["  none"]
    if a.max_table:
        lines += max_context_table()
    lines += ["", "Sources and configurations:"]
    for row in rows:
        lines.append(f"  {row.id}: {row.source}; {row.ranks} rank(s), {row.gpus_per_node} per node, "
                     f"{row.gpu_mem_gib:g} GiB; {' '.join(row.overrides) or '-'}")
    lines.append(f"\n({time.perf_counter() - t0:.0f}s)")
    report(lines, RESULT if a.save else None)


if __name__ == "__main__":
    main()
