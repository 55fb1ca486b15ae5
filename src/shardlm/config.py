"""One typed config tree: TOML file + `--section.key=value` overrides, validated with clear messages.

Every field carries its documentation in `metadata["doc"]`: `shardlm train --help` prints it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import tomli_w

from shardlm.errors import ConfigError


def _f(default: Any, doc: str, key: str | None = None) -> Any:
    """A documented field; `key` is its config name when that can't be a Python name (`async`)."""
    meta = {"doc": doc, "key": key} if key else {"doc": doc}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _at_least(lo: float, **values: float) -> None:
    """`section.key must be >= lo, got v` for the first value under `lo` (keys given as section__key)."""
    for key, v in values.items():
        if v < lo:
            raise ConfigError(f"{key.replace('__', '.')} must be >= {lo:g}, got {v}")



@dataclass
class ModelSection:
    preset: str = _f("debug", "Exact name of a model shape in shardlm.models.presets (see `shardlm presets`).")
    init_from: str = _f("", "`hf:/path/to/dir`: shape from its config.json, weights from its safetensors; "
                        "`dcp:/path/to/step-N`: shape and weights from a DCP checkpoint (`shardlm convert hf-to-dcp` "
                        "output or a shardlm checkpoint; a fresh start, not a resume). Each rank reads only its "
                        "shards. Empty = random init of model.preset.")
    n_layers: int | None = _f(None, "Override the preset's number of transformer blocks (e.g. to fit a benchmark).")
    dim: int | None = _f(None, "Override the preset's hidden size.")
    n_heads: int | None = _f(None, "Override the preset's number of attention heads.")
    n_kv_heads: int | None = _f(None, "Override the preset's number of key/value heads (GQA).")
    ffn_dim: int | None = _f(None, "Override the preset's SwiGLU hidden size.")
    vocab_size: int | None = _f(None, "Override the preset's vocabulary size.")
    n_experts: int | None = _f(None, "Override the preset's number of experts per MoE layer (a mixture-of-experts "
                               "preset; docs/moe.md).")
    n_experts_per_tok: int | None = _f(None, "Override the preset's top-k: experts each token is routed to.")
    moe_ffn_dim: int | None = _f(None, "Override the preset's expert SwiGLU hidden size.")
    router_aux_loss_coef: float | None = _f(None, "Load-balancing loss coefficient of a mixture of experts (HF's "
                                            "router_aux_loss_coef; default: the preset's or config.json's; 0 = off). "
                                            "Allowed with model.init_from: it changes training, not the shape.")
    router_z_loss_coef: float | None = _f(None, "Router z-loss coefficient (ST-MoE; default 0 = off).")

    @property
    def hf_dir(self) -> Path | None:
        """The folder model.init_from names (`hf:/path`), or None for a random init."""
        return Path(self.init_from[len("hf:"):]) if self.init_from.startswith("hf:") else None

    @property
    def dcp_dir(self) -> Path | None:
        """The checkpoint model.init_from names (`dcp:/path`), or None."""
        return Path(self.init_from[len("dcp:"):]) if self.init_from.startswith("dcp:") else None

    def check(self) -> None:
        for key in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "n_experts",
                    "n_experts_per_tok", "moe_ffn_dim"):
            v = getattr(self, key)
            if v is not None and v < 1:
                raise ConfigError(f"model.{key} must be >= 1, got {v}")
        for key in ("router_aux_loss_coef", "router_z_loss_coef"):
            v = getattr(self, key)
            if v is not None and not 0.0 <= v < 1.0:
                raise ConfigError(f"model.{key} must be in [0, 1), got {v}")
        if self.init_from and not self.init_from.startswith(("hf:", "dcp:")):
            raise ConfigError(f"model.init_from={self.init_from!r}: use hf:/path/to/hf_model_dir or "
                              "dcp:/path/to/checkpoint")


@dataclass
class LoraSection:
    rank: int = _f(0, "LoRA rank r; 0 = no LoRA (full fine-tuning or pre-training).")
    alpha: float = _f(16.0, "LoRA alpha: the update is scaled by alpha / rank.")
    dropout: float = _f(0.0, "Dropout on the LoRA input.")
    targets: list[str] = _f(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                            "Linear layers that get adapters (HF/peft names).")
    train_embeddings: bool = _f(False, "Also train the embeddings (and untied output head).")
    train_norms: bool = _f(False, "Also train the RMSNorm weights.")
    adapters_only: bool = _f(False, "Checkpoints hold only the trainable parameters (adapters) and their "
                             "optimizer state: small; resuming re-reads the base from model.init_from.")
    base_dtype: Literal["auto", "bf16", "fp32", "nf4"] = _f(
        "auto", "How the frozen base weights are stored (they are never updated): auto = the training precision "
        "(bf16 under bf16/fp8, fp32 under fp32); bf16; fp32; nf4 = QLoRA: the base linears (lora.targets) and the "
        "adapted stacked expert projections as torchao NF4 (4-bit, block size 64, double-quantised scales), "
        "all-gathered in NF4, dequantised per matmul (needs the [fp8] extra: torchao).")

    @property
    def scaling(self) -> float:
        """alpha / rank: what the adapters' update B @ A is multiplied by (0.0 without LoRA)."""
        return self.alpha / self.rank if self.rank > 0 else 0.0

    def check(self) -> None:
        if self.rank < 0 or self.alpha <= 0 or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.rank must be >= 0, lora.alpha > 0 and lora.dropout in [0, 1); got "
                              f"{self.rank}, {self.alpha}, {self.dropout}")
        if self.rank and not self.targets:
            raise ConfigError("lora.targets is empty; name the linear layers to adapt (e.g. q_proj,v_proj)")
        if self.base_dtype == "nf4" and not self.rank:
            raise ConfigError("lora.base_dtype=nf4 (QLoRA) quantises the frozen base of LoRA layers: set lora.rank > "
                              "0, or use lora.base_dtype=auto")
        if self.base_dtype != "auto" and not self.rank:  # nothing is frozen: the setting would have no effect
            raise ConfigError(f"lora.base_dtype={self.base_dtype} stores the frozen base of a LoRA run, and "
                              "lora.rank=0 trains every weight: set lora.rank > 0, or drop lora.base_dtype (auto)")


@dataclass
class ParallelSection:
    dp_replicate: int | Literal["auto"] = _f(
        1, "Replicas of the sharded model (HSDP across nodes); 1 = plain FSDP; auto = world_size / dp_shard, or, "
        "with dp_shard=auto too, chosen from the topology (see parallel.dp_shard).")
    dp_shard: int | Literal["auto"] = _f(
        -1, "Ranks each parameter is sharded over; -1 = world_size / dp_replicate. auto with dp_replicate=auto: "
        "shard within a node (or within parallel.nvlink_domain ranks) and replicate across nodes (HSDP) when the "
        "model state sharded that way takes at most half of a device's memory, else shard over every rank; the "
        "startup line says which and why. Node boundaries come from the launcher (LOCAL_WORLD_SIZE, "
        "SLURM_NTASKS_PER_NODE), never guessed.")
    cp: int = _f(
        1, "Context-parallel degree: each sequence's tokens split over this many consecutive ranks, attention by "
        "all-to-all over heads (Ulysses), so one sequence's activations shrink by cp; FSDP shards the parameters "
        "over dp_shard x cp. Must divide the attention heads and data.seq_len; dp_replicate x dp_shard x cp = "
        "world size. For sequences whose activations outgrow one GPU (docs/long-context.md); training and validation "
        "only (generate and eval refuse it).")
    nvlink_domain: int = _f(
        0, "Ranks that share one NVLink domain, for parallel.dp_shard=auto; 0 = one node (the launcher's ranks per "
        "node). E.g. 72 on GB200 NVL72 racks.")
    init_timeout_s: float = _f(
        600.0, "Timeout of every collective until the first step is done (covers compile, data preparation and the "
        "checkpoint load).")
    step_timeout_s: float = _f(
        300.0, "Timeout of every collective after the first step: a dead or stalled peer ends every other rank "
        "within this (plus 30 s) with one line naming the step, the collective phase and the rank waited for.")
    preflight: bool | Literal["auto", "strict"] = _f(
        "auto", "Before step 1 each rank times a GEMM and an all-reduce on every mesh dimension and a rank more "
        "than 20% slower than the median is named: true/false, auto (= true on more than one node), strict "
        "(stop, exit 9, when a rank is slow).")
    reshard_after_forward: int | bool | Literal["auto"] = _f(
        "auto", "Free each block's unsharded parameters after its forward (ZeRO-3) and all-gather them again in "
        "backward. true: every block but the last (backward needs it at once); false: none (ZeRO-2: more memory, "
        "one all-gather less per block); N: the last N blocks keep theirs (the first N of backward); auto: starts as "
        "true and, on GPUs after step 2, keeps as many more of the last blocks as fit in the memory its peak left "
        "free (less 10% of the device), so it never needs memory that true would leave free; 1 on CPU or with "
        "train.cpu_offload. The log says which N and why.")
    prefetch: int = _f(
        1, "Blocks whose parameters FSDP all-gathers ahead of use: 1 = FSDP2's implicit prefetch of the next block; "
        "N > 1 = explicitly the next N blocks in forward and the previous N in backward (more overlap of "
        "all-gathers with compute, N unsharded blocks of memory in flight). Losses do not change.")

    def check(self) -> None:
        if self.dp_replicate != "auto" and self.dp_replicate < 1:
            raise ConfigError(f"parallel.dp_replicate must be >= 1 or auto, got {self.dp_replicate}")
        if self.dp_shard != "auto" and self.dp_shard < 1 and self.dp_shard != -1:
            raise ConfigError(f"parallel.dp_shard must be >= 1, -1 (fill) or auto, got {self.dp_shard}")
        if self.dp_shard == -1 and self.dp_replicate == "auto":
            raise ConfigError("parallel.dp_replicate=auto needs parallel.dp_shard as a number of ranks or auto "
                              "(-1 means 'the rest of the world', which leaves nothing to choose)")
        r = self.reshard_after_forward
        if isinstance(r, int) and not isinstance(r, bool) and r < 1:
            raise ConfigError(f"parallel.reshard_after_forward must be true, false, auto or a number of blocks >= 1, "
                              f"got {r}")
        if self.cp < 1:
            raise ConfigError(f"parallel.cp must be >= 1 (1 = no context parallelism), got {self.cp}")
        if self.prefetch < 1:
            raise ConfigError(f"parallel.prefetch must be >= 1 (1 = FSDP's implicit prefetch of the next block), "
                              f"got {self.prefetch}")
        self._check_nvlink()
        for key, v in (("parallel.init_timeout_s", self.init_timeout_s),
                       ("parallel.step_timeout_s", self.step_timeout_s)):
            if v <= 0:
                raise ConfigError(f"{key} must be > 0 seconds, got {v}")

    def _check_nvlink(self) -> None:
        if self.nvlink_domain < 0:
            raise ConfigError(f"parallel.nvlink_domain must be >= 0 (0 = one node), got {self.nvlink_domain}")
        if self.nvlink_domain and (self.dp_shard != "auto" or self.dp_replicate != "auto"):
            raise ConfigError(f"parallel.nvlink_domain={self.nvlink_domain} only shapes the mesh when "
                              f"parallel.dp_shard and dp_replicate are both auto, but dp_shard={self.dp_shard}, "
                              f"dp_replicate={self.dp_replicate}: set both to auto or drop nvlink_domain")


@dataclass
class TrainSection:
    steps: int = _f(100, "Optimizer steps to run.")
    output_dir: str = _f("runs/default", "Where config.toml, metrics.jsonl and checkpoints go.")
    seed: int = _f(0, "Seed for initialisation, data order and sampling; runs are deterministic on CPU.")
    micro_batch_size: int = _f(8, "Sequences per rank per micro-batch.")
    grad_accum: int = _f(1, "Micro-batches per optimizer step (see train.grad_sync for when gradients are reduced).")
    grad_sync: Literal["micro_batch", "step"] = _f(
        "micro_batch", "With train.grad_accum > 1: micro_batch = reduce-scatter after every micro-batch, so gradients "
        "stay sharded and memory does not depend on grad_accum (HSDP defers only the cross-replica all-reduce to the "
        "last micro-batch); step = no gradient collective before the last micro-batch: less traffic, but every rank "
        "holds the unsharded gradients of every trainable parameter.")
    mixed_precision: Literal["auto", "bf16", "fp32", "fp8"] = _f(
        "auto", "auto: fp32 on CPU (no fast bf16 matmuls there), bf16 on GPUs; bf16: bf16 params/compute with "
        "fp32 master weights and optimizer state; fp32: all fp32; fp8: bf16 plus torchao float8 linears (needs "
        "the [fp8] extra and an FP8-capable GPU).")
    fp8_recipe: Literal["tensorwise", "rowwise"] = _f(
        "tensorwise", "torchao float8 scaling: tensorwise (float8 all-gather in FSDP) or rowwise (more accurate).")
    fp8_emulate: bool = _f(False, "Emulate the float8 matmuls (any device; slow): for tests on CPU.")
    reduce_dtype: Literal["fp32", "bf16"] = _f("fp32", "Dtype of the gradient reduce-scatter/all-reduce.")
    ac: Literal["none", "full", "selective", "selective_op"] = _f(
        "none", "Activation checkpointing: none; full (every block); selective (every train.ac_every-th block); "
        "selective_op (save matmul outputs, recompute the rest).")
    ac_every: int = _f(2, "With train.ac=selective: checkpoint every n-th block.")
    loss_chunk_tokens: int = _f(
        4096, "The output head and the cross-entropy run over this many tokens of a micro-batch at a time, each "
        "chunk recomputed in backward: at most (chunk, vocab) logits exist, never the full (tokens, vocab) fp32 "
        "ones (same loss and gradients; one more head forward per step). 0 = all tokens at once.")
    cpu_offload: bool = _f(False, "Keep sharded parameters, gradients and optimizer state in CPU memory "
                           "(FSDP2 CPUOffloadPolicy; the optimizer step runs on the CPU).")
    compile: bool = _f(False, "torch.compile each transformer block (worth it on GPUs; off on CPU).")
    compile_backend: str = _f("inductor", "torch.compile backend for train.compile: inductor (fused kernels), "
                              "aot_eager (traces forward and backward, no codegen: for debugging), eager.")
    attention_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = _f(
        "auto", "SDPA kernel for causal attention in training: auto = cuDNN first on Hopper GPUs (bf16/fp16, "
        "head_dim <= 128, a torch with cuDNN attention), else torch's own choice (flash on Ampere+, the CPU "
        "kernel on CPU); flash | cudnn | efficient | math = only that kernel (an unavailable one stops at "
        "startup). Document-masked flex attention is not affected. The startup line says which.")
    lr: float = _f(3e-4, "Peak learning rate (AdamW).")
    warmup_steps: int = _f(10, "Linear warmup steps from ~0 to train.lr.")
    lr_schedule: Literal["cosine", "linear", "constant"] = _f("cosine", "Decay after warmup.")
    min_lr_ratio: float = _f(0.1, "Final learning rate as a fraction of train.lr (cosine and linear).")
    weight_decay: float = _f(0.1, "AdamW weight decay, applied to matrices only (not norms or biases).")
    beta1: float = _f(0.9, "AdamW beta1.")
    beta2: float = _f(0.95, "AdamW beta2.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    optimizer_state_dtype: Literal["fp32", "bf16", "int8"] = _f(
        "fp32", "AdamW moments: fp32; bf16 (half the bytes; master weights stay fp32); int8 = torchao's 8-bit AdamW "
        "(block-wise quantised moments, a quarter of the bytes; needs the [fp8] extra: torchao). The update is fp32 in "
        "every case. int8 keeps fp32 moments for tensors under 4096 values (norms) and needs each rank's shard of a "
        "matrix to be whole 256-value blocks (always so when model.dim is a multiple of 256). A checkpoint saved "
        "under another setting resumes by conversion.")
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this value; 0 disables clipping.")
    nonfinite: Literal["stop", "skip"] = _f(
        "stop", "Checked every step on every rank, before the optimizer step: a NaN/inf loss or gradient norm. "
        "stop = exit (code 6) naming the step, the rank(s) and what went bad, the last checkpoint intact; "
        "skip = drop that update (optimizer and schedule unchanged; the batch is consumed) and go on.")
    max_skipped_steps: int = _f(10, "With train.nonfinite=skip: stop after this many non-finite steps in a row.")
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "auto = cuda when available (NCCL), else cpu (gloo).")
    sample_tokens: int = _f(0, "After training, generate this many tokens from train.sample_prompt and print them.")
    sample_prompt: str = _f("def ", "Prompt for the end-of-training sample.")

    def precision(self, device_type: str) -> str:
        """train.mixed_precision with `auto` resolved for a device: fp32 on CPU, bf16 on accelerators."""
        if self.mixed_precision != "auto":
            return self.mixed_precision
        return "fp32" if device_type == "cpu" else "bf16"

    def check(self) -> None:
        _at_least(1, train__steps=self.steps, train__micro_batch_size=self.micro_batch_size,
                  train__grad_accum=self.grad_accum, train__ac_every=self.ac_every,
                  train__max_skipped_steps=self.max_skipped_steps)
        _at_least(0, train__seed=self.seed, train__lr=self.lr, train__warmup_steps=self.warmup_steps,
                  train__weight_decay=self.weight_decay, train__grad_clip=self.grad_clip,
                  train__sample_tokens=self.sample_tokens, train__eps=self.eps,
                  train__loss_chunk_tokens=self.loss_chunk_tokens)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for key, v in (("train.beta1", self.beta1), ("train.beta2", self.beta2)):
            if not 0.0 <= v < 1.0:
                raise ConfigError(f"{key} must be in [0, 1), got {v}")
        if not self.output_dir:
            raise ConfigError("train.output_dir must not be empty")


@dataclass
class DataSource:
    """One source of a mixture: a [[data.sources]] table."""

    path: str = _f("", "A token store or files, as data.path.")
    weight: float = _f(1.0, "Share of the training samples (normalised over the sources).")
    epochs: float | None = _f(None, "Cap: at most this many passes over the source (then it drops out).")
    text_field: str = _f("", "Field holding the text in this source's records; empty = data.text_field.")


@dataclass
class DataSection:
    path: str = _f(
        "builtin:stdlib", "Training data: a token store (`store:DIR`, or a directory holding its manifest.json; "
        "`shardlm prepare` makes one), or files prepared into a store in data.cache_dir first: .txt, .jsonl, "
        ".jsonl.gz, .jsonl.zst, .parquet, .arrow, HF `save_to_disk` folders, a directory or a glob of them; "
        "`builtin:stdlib` = the running Python's standard library.")
    sources: list[DataSource] = _f(
        [], "A mixture instead of data.path: [[data.sources]] tables with path, weight, epochs, text_field "
        "(or --data.sources=PATH:WEIGHT,PATH:WEIGHT; --data.sources.N.weight=W changes one). Sampled per sample, "
        "deterministically from train.seed; a resume keeps what each source consumed and applies the current "
        "weights from there.")
    format: Literal["text", "sft"] = _f(
        "text", "text: documents packed for next-token prediction; sft: JSONL with messages, prompt/completion or "
        "instruction/input/output, loss only on the answers.")
    text_field: str = _f("text", "Field holding the text in .jsonl records.")
    tokenizer: str = _f("auto", "`auto` (the model.init_from directory's tokenizer.json, else the token store's, else "
                        "bytes), `bytes` "
                        "(UTF-8 bytes + EOS, vocab 257), or a path to an HF tokenizer.json (or its directory).")
    pack: bool = _f(True, "sft: pack samples into seq_len windows (true) or pad one sample per row (false).")
    seq_len: int = _f(128, "Tokens per training sequence (documents are packed, EOS-separated).")
    shuffle: bool = _f(True, "Shuffle the packed sequences (a fresh permutation every epoch).")
    cache_dir: str = _f("", "Where raw files are prepared into token stores (once per shared filesystem); empty = "
                         "$XDG_CACHE_HOME/shardlm/tokens (~/.cache/shardlm/tokens).")
    prepare_workers: int = _f(0, "Processes that tokenise raw files into the cache (0 = every core).")
    max_bad_fraction: float = _f(
        0.001, "Malformed records (bad JSON, missing or null text field, not UTF-8) are skipped and reported with "
        "their file and line or row; more than this share of them is an error.")
    val_path: str = _f("", "Validation data (a store or files): fixed, the same on every world size. Empty = the "
                       "store's val/ when data.path is a store prepared with --val-fraction or --val (a mixture: "
                       "each source store's own val/).")
    document_mask: bool = _f(
        False, "Packed documents do not see each other: positions (RoPE) restart at each document, attention stays "
        "within it, and the target across a boundary is dropped.")
    verify: bool = _f(
        False, "Recompute the token stores' sha256 checksums at start (the first rank of each node reads every byte "
        "once): a damaged copy stops with one line. Without it, every micro-batch's ids are still checked against "
        "the model's vocabulary (cheap).")

    def check(self) -> None:
        _at_least(1, data__seq_len=self.seq_len)
        if not 0.0 <= self.max_bad_fraction <= 1.0 or self.prepare_workers < 0:
            raise ConfigError(f"data.max_bad_fraction must be in [0, 1] and data.prepare_workers >= 0 (0 = every "
                              f"core); got {self.max_bad_fraction}, {self.prepare_workers}")
        if self.document_mask and self.format == "sft" and not self.pack:
            raise ConfigError("data.document_mask has no effect with data.pack=false (one sample per row already); "
                              "drop it or pack the samples")
        if self.sources:
            self._check_sources()

    def _check_sources(self) -> None:
        if self.path != DataSection().path:
            raise ConfigError("data.path and data.sources are both set; a mixture reads data.sources only: drop "
                              "data.path (or the sources)")
        if self.format != "text":
            raise ConfigError("data.sources (mixtures) are for data.format=text; for SFT pass one data.path")
        for i, src in enumerate(self.sources):
            if not src.path:
                raise ConfigError(f"data.sources.{i}.path is empty; name a token store or files")
            if not src.weight > 0:
                raise ConfigError(f"data.sources.{i}.weight must be > 0, got {src.weight}")
            if src.epochs is not None and not src.epochs > 0:
                raise ConfigError(f"data.sources.{i}.epochs must be > 0 (or left out: no cap), got {src.epochs}")


@dataclass
class MetricsSection:
    log_every: int = _f(10, "Log a metrics line (and a metrics.jsonl record) every N steps.")
    progress_bar: bool = _f(True, "Show a progress bar on rank 0 when stderr is a terminal.")
    tensorboard: bool = _f(False, "Also write TensorBoard events to <output_dir>/tb (needs the [viz] extra).")
    wandb: bool = _f(False, "Also log the metrics.jsonl scalars (train/<name>, val/<name>) and the resolved config to "
                     "Weights & Biases from rank 0 (needs the [wandb] extra). The run id is kept in "
                     "<output_dir>/wandb_id, so a resumed run continues the same W&B run; WANDB_MODE=offline logs "
                     "under <output_dir>/wandb/ for a later `wandb sync`.")
    wandb_project: str = _f("shardlm", "W&B project.")
    wandb_run_name: str = _f("", "W&B run name; empty = W&B picks one.")
    phase_sync: bool = _f(False, "Synchronise the GPU at the end of the optimizer phase so time_optimizer_s counts "
                          "its kernels (one more sync per step). Off: time_optimizer_s is its launch time and the "
                          "optimizer's GPU time shows in the next step's time_compute_s.")

    def check(self) -> None:
        _at_least(1, metrics__log_every=self.log_every)


@dataclass
class EvalSection:
    interval: int = _f(0, "Evaluate the validation loss every N optimizer steps; 0 = never in the loop. The set is "
                       "data.val_path, or the val/ of the store data.path names (of each store data.sources names).")
    max_tokens: int = _f(0, "Evaluate this many tokens' worth of the validation set: its first max_tokens // "
                         "data.seq_len rows (windows of text, packed or padded rows of SFT samples), always the same "
                         "ones; 0 = the whole set.")
    at_end: bool = _f(True, "Evaluate once more after the last step (when there is validation data).")
    micro_batch_size: int = _f(0, "Rows per evaluation forward; 0 = train.micro_batch_size.")

    def check(self) -> None:
        for key, v in (("eval.interval", self.interval), ("eval.max_tokens", self.max_tokens),
                       ("eval.micro_batch_size", self.micro_batch_size)):
            if v < 0:
                raise ConfigError(f"{key} must be >= 0 (0 = {'off' if key == 'eval.interval' else 'the default'}), "
                                  f"got {v}")


@dataclass
class ProfileSection:
    enabled: bool = _f(False, "Trace optimizer steps [start_step, start_step + steps) with torch.profiler on every "
                       "rank into <output_dir>/profile/rank{R}-steps{a}-{b}.json.gz (open in ui.perfetto.dev), and on "
                       "CUDA the allocator's history into rank{R}-memory-steps{a}-{b}.pickle (pytorch.org/memory_viz).")
    start_step: int = _f(3, "First optimizer step traced (1-based). Start after warm-up (compile, allocator "
                         "growth): the first traced step also carries the profiler's start-up.")
    steps: int = _f(2, "How many optimizer steps to trace (a ProfilerStep#N span each).")
    memory: bool = _f(True, "On CUDA also record a memory snapshot over the traced steps (up to 100,000 allocation "
                      "events).")

    def check(self) -> None:
        if not self.enabled:
            return
        if self.start_step < 1:
            raise ConfigError(f"profile.start_step must be >= 1 (the first optimizer step to trace), got "
                              f"{self.start_step}")
        if self.steps < 1:
            raise ConfigError(f"profile.steps must be >= 1 (how many steps to trace), got {self.steps}")


@dataclass
class CheckpointSection:
    interval: int = _f(0, "Save a checkpoint every N steps; 0 = only at the end (and on SIGTERM or Ctrl-C).")
    keep_last: int = _f(3, "Keep the newest N complete checkpoints, prune older ones; 0 = keep all.")
    async_: bool = _f(False, "Save with DCP async_save: training goes on while the checkpoint is written "
                      "(from a copy taken at the step, over a gloo group of its own).", key="async")
    resume: str = _f("auto", "`auto` = the newest complete checkpoint in the checkpoint folder (if any), a path "
                     "to a checkpoint, or `none` (start fresh).")
    model_only: bool = _f(False, "Let the final checkpoint hold the model only (for export); periodic ones stay full.")
    save_final: bool = _f(True, "Save a checkpoint when training ends.")
    dir: str = _f("", "Checkpoint folder; empty = <train.output_dir>/checkpoints.")
    allow_changed: list[str] = _f(
        [], "Fields a resume may change on purpose (e.g. lora.dropout, tokenizer, data): a resume compares the "
        "checkpoint's model shape, LoRA setup, tokenizer and training data (each source's content) with the "
        "run's and stops, naming each difference, unless the field is listed here.")
    preempt_grace_s: float = _f(
        25.0, "On SIGTERM or Ctrl-C every rank finishes its step, saves and exits 0 (Ctrl-C: 130); past this many "
        "seconds it gives up (exit 1; Ctrl-C: 130) and the last complete checkpoint stands. Keep it under "
        "the launcher's kill timeout.")

    def check(self) -> None:
        _at_least(0, checkpoint__interval=self.interval, checkpoint__keep_last=self.keep_last,
                  checkpoint__preempt_grace_s=self.preempt_grace_s)


@dataclass
class EnvSection:
    preset: str = _f(
        "auto", "NCCL / torch environment preset, applied before the process group starts (never overriding a "
        "variable you set, in the environment or /etc/nccl.conf): h100-ib, h100-efa, h100-gcp, a100-ib, roce, "
        "single-node, cpu, none, or auto (detected from the machine). `shardlm env --list` lists them.")
    set_: dict[str, str] = _f(
        {}, "Site-specific variables to set as well, e.g. [env.set] NCCL_IB_HCA = \"=mlx5_0,mlx5_1\" (or "
        "--env.set.NCCL_IB_HCA==mlx5_0,mlx5_1); they override the preset's values, not your environment's.",
        key="set")

    def check(self) -> None:
        bad = [k for k in self.set_ if not k or not all(c.isalnum() or c == "_" for c in k) or k[0].isdigit()]
        if bad:
            raise ConfigError(f"env.set: {bad[0]!r} is not an environment variable name (letters, digits, _)")


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    lora: LoraSection = field(default_factory=LoraSection)
    env: EnvSection = field(default_factory=EnvSection)
    eval: EvalSection = field(default_factory=EvalSection)
    profile: ProfileSection = field(default_factory=ProfileSection)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {s.name: _plain(getattr(self, s.name)) for s in dataclasses.fields(self)}

    def check(self) -> None:
        """Each section's own fields, then what ties two sections together."""
        for s in dataclasses.fields(self):
            getattr(self, s.name).check()
        pr, lo = self.profile, self.lora
        if pr.enabled and pr.start_step > self.train.steps:
            raise ConfigError(f"profile.start_step={pr.start_step} is past train.steps={self.train.steps}: nothing "
                              "would be traced; lower profile.start_step")
        if lo.adapters_only and not (lo.rank and self.model.hf_dir):
            raise ConfigError("lora.adapters_only needs lora.rank > 0 and model.init_from=hf:<dir> (the base to "
                              "re-read)")

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())


def _plain(v: Any) -> Any:
    """A section (or [[table]] entry) as TOML-able values; None is left out (TOML has no null)."""
    if dataclasses.is_dataclass(v):
        return {_key(f): _plain(getattr(v, f.name)) for f in dataclasses.fields(v) if getattr(v, f.name) is not None}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


# -- parsing -------------------------------------------------------------------------------------

def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


def _fields(section_cls: type) -> dict[str, dataclasses.Field]:
    return {_key(f): f for f in dataclasses.fields(section_cls)}


def _unknown(kind: str, name: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(valid)}"
    return ConfigError(f"unknown config {kind} {name!r}; {hint}")


def _resolve_key(dotted: str) -> tuple[str, dataclasses.Field]:
    if "." not in dotted:
        raise ConfigError(f"config key {dotted!r} must look like section.key (e.g. train.steps)")
    section, key = dotted.split(".", 1)
    sections = _sections()
    if section not in sections:
        raise _unknown("section", section, list(sections))
    fields = _fields(sections[section])
    if key not in fields:
        all_keys = [f"{section}.{k}" for k in fields] + [f"{s}.{k}" for s, c in sections.items() for k in _fields(c)]
        close = difflib.get_close_matches(dotted, all_keys, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid keys in [{section}]: {', '.join(fields)}"
        raise ConfigError(f"unknown config key {dotted!r}; {hint}")
    return section, fields[key]


def _type_args(tp: Any) -> tuple[list[Any], bool]:
    """(the types a field accepts, optional?) of a field annotation: `int | Literal["auto"]` -> [int, Literal]."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args, len(args) < len(typing.get_args(tp))
    return [tp], False


def _type_name(base: Any) -> str:
    if typing.get_origin(base) is Literal:
        return " | ".join(map(repr, typing.get_args(base)))
    if typing.get_origin(base) is dict:
        return "table of strings"
    if typing.get_origin(base) is list and dataclasses.is_dataclass(typing.get_args(base)[0]):
        return "array of tables (" + ", ".join(_fields(typing.get_args(base)[0])) + ")"
    return getattr(base, "__name__", str(base))


def _coerce(dotted: str, tp: Any, value: Any, from_string: bool) -> Any:
    """Check (TOML) or parse (command line) `value` against the annotation `tp` (the first type of a
    union that takes it; a string naming a Literal choice wins over parsing it as another type)."""
    bases, optional = _type_args(tp)
    if optional and (value is None or (from_string and str(value).lower() in ("none", "null", ""))):
        return None
    if len(bases) == 1:
        return _coerce_one(dotted, bases[0], value, from_string)
    literals = [b for b in bases if typing.get_origin(b) is Literal]
    for base in literals + [b for b in bases if b not in literals]:
        try:
            return _coerce_one(dotted, base, value, from_string)
        except ConfigError:
            pass
    raise ConfigError(f"{dotted} expects {' or '.join(_type_name(b) for b in bases)}, got {value!r}")


def _coerce_one(dotted: str, base: Any, value: Any, from_string: bool) -> Any:
    if typing.get_origin(base) is dict:  # dict[str, str]: a TOML table (or NAME=value,... on the command line)
        if from_string and isinstance(value, str):
            value = dict(kv.split("=", 1) for kv in value.split(",") if "=" in kv) if value else {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{dotted} expects a table of NAME = \"value\" strings, got {value!r}")
        bad = [k for k, v in value.items() if not isinstance(v, (str, int, float)) or isinstance(v, bool)]
        if bad:
            raise ConfigError(f"{dotted}.{bad[0]} must be a string, got {value[bad[0]]!r}")
        return {k: str(v) for k, v in value.items()}
    if typing.get_origin(base) is list and dataclasses.is_dataclass(typing.get_args(base)[0]):
        return _coerce_tables(dotted, typing.get_args(base)[0], value, from_string)
    if typing.get_origin(base) is list:  # list[str]: a TOML array, or comma-separated on the command line
        if from_string and isinstance(value, str):
            value = _string_list(value)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{dotted} expects a list of strings (TOML array or a,b,c), got {value!r}")
        return value
    if typing.get_origin(base) is Literal:
        choices = typing.get_args(base)
        if value not in choices:
            raise ConfigError(f"{dotted} must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if from_string and str(value).lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return str(value).lower() in ("true", "1", "yes", "on")
        elif base is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if from_string:
                return int(value)
        elif base is float:
            if (isinstance(value, (int, float)) and not isinstance(value, bool)) or from_string:
                number = float(value)
                if not math.isfinite(number):  # a NaN passes every `<` check below and poisons the run
                    raise ConfigError(f"{dotted} must be a finite number, got {value!r}")
                return number
        elif base is str:
            if isinstance(value, str):
                return value
    except ValueError:
        pass
    raise ConfigError(f"{dotted} expects {base.__name__}, got {value!r} ({type(value).__name__})")


def _coerce_tables(dotted: str, cls: type, value: Any, from_string: bool) -> list:
    """[[data.sources]]: a TOML array of tables, or PATH:WEIGHT[:EPOCHS],... on the command line."""
    if from_string and isinstance(value, str):
        value = [_source_entry(dotted, item) for item in value.split(",") if item.strip()]
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{dotted} expects [[{dotted}]] tables (or PATH:WEIGHT,... on the command line), got {value!r}")
    hints, fields = typing.get_type_hints(cls), _fields(cls)
    out = []
    for i, table in enumerate(value):
        obj = cls()
        for key, v in table.items():
            if key not in fields:
                raise _unknown("key", f"{dotted}.{i}.{key}", [f"{dotted}.{i}.{k}" for k in fields])
            setattr(obj, fields[key].name, _coerce(f"{dotted}.{i}.{key}", hints[fields[key].name], v, from_string))
        out.append(obj)
    return out


def _string_list(text: str) -> list[str]:
    """A list typed on the command line, in any of the forms users type: a,b / [a,b] / ["a", "b"] / ['a','b']."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    items = [v.strip() for v in text.split(",")]
    return [v[1:-1] if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"" else v for v in items if v]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _source_entry(dotted: str, item: str) -> dict[str, str]:
    parts = item.strip().rsplit(":", 2)
    # anything float() reads is meant as a weight (or epochs), -1 and nan too: their check then names them
    numeric = [p for p in parts[1:] if _is_number(p)]
    if len(parts) == 1 or not numeric:
        return {"path": item.strip()}
    if len(parts) == 3 and len(numeric) == 2:
        return {"path": parts[0], "weight": parts[1], "epochs": parts[2]}
    path, weight = item.strip().rsplit(":", 1)
    return {"path": path, "weight": weight}


def set_value(cfg: Config, dotted: str, value: Any, from_string: bool = False) -> None:
    """Set one key; a table key (env.set) also takes `env.set.NAME`, and adds to what is there; an array of
    tables (data.sources) takes `data.sources.N.key` for one entry."""
    parts = dotted.split(".")
    if len(parts) == 4 and parts[2].isdigit():
        tp = _field_type(parts[0], parts[1])
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            entries = getattr(getattr(cfg, parts[0]), _fields(_sections()[parts[0]])[parts[1]].name)
            i = int(parts[2])
            if i >= len(entries):
                raise ConfigError(f"{dotted}: there are {len(entries)} {parts[0]}.{parts[1]} entries (0-based); "
                                  "add the entry in the TOML file first")
            cls = typing.get_args(tp)[0]
            fields = _fields(cls)
            if parts[3] not in fields:
                raise _unknown("key", dotted, [f"{parts[0]}.{parts[1]}.{i}.{k}" for k in fields])
            setattr(entries[i], fields[parts[3]].name,
                    _coerce(dotted, typing.get_type_hints(cls)[fields[parts[3]].name], value, from_string))
            return
    head, _, item = dotted.rpartition(".")
    if head.count(".") == 1 and typing.get_origin(_field_type(*head.split("."))) is dict:
        dotted, value = head, {item: value}  # env.set.NCCL_DEBUG=INFO: one entry of the table
    section, fld = _resolve_key(dotted)
    section_obj = getattr(cfg, section)
    tp = typing.get_type_hints(type(section_obj))[fld.name]
    new = _coerce(dotted, tp, value, from_string)
    if isinstance(new, dict):
        new = {**getattr(section_obj, fld.name), **new}
    setattr(section_obj, fld.name, new)


def _field_type(section: str, key: str) -> Any:
    """The annotation of section.key, or None when there is no such key."""
    cls = _sections().get(section)
    fld = None if cls is None else _fields(cls).get(key)
    return None if fld is None else typing.get_type_hints(cls)[fld.name]


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """`--a.b=v` or `--a.b v` -> [("a.b", "v")]."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key=value")
        if "=" in arg:
            key, val = arg[2:].split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, val = arg[2:], args[i + 1]
            i += 1
        else:
            raise ConfigError(f"override {arg!r} has no value; write --section.key=value")
        out.append((key, val))
        i += 1
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- TOML file <- command-line overrides, then validation."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found; pass an existing TOML file (e.g. configs/debug.toml)")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"top-level key {section!r} in {p} must be a [section] table")
            for key, value in table.items():
                set_value(cfg, f"{section}.{key}", value)
    for key, value in parse_overrides(overrides or []):
        set_value(cfg, key, value, from_string=True)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Every field in range and every combination meaningful, or one ConfigError naming it and the fix."""
    cfg.check()


def describe() -> str:
    """Every config key with its type, default and documentation: the user's manual."""
    lines = []
    for name, cls in _sections().items():
        lines.append(f"[{name}]")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            bases, optional = _type_args(hints[f.name])
            tname = " | ".join(map(_type_name, bases)) + (" | none" if optional else "")
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            lines.append(f"  {name}.{_key(f)} = {default!r}  ({tname})")
            lines.append(f"      {f.metadata['doc']}")
    return "\n".join(lines)
