"""Trainer: build the mesh, model, optimizer and data from a Config; run the loop."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlm.checkpoint import Checkpointer
from shardlm.config import Config
from shardlm.data import build_loader, load_tokenizer, resolve_files
from shardlm.data.loader import IGNORE_INDEX, default_cache_dir
from shardlm.distributed.env import (
    init_distributed,
    launched_world_size,
    restart_store_warning,
    shutdown_distributed,
)
from shardlm.errors import ConfigError, TrainingError
from shardlm.generate import generate
from shardlm.models import ModelConfig, Transformer, get_preset
from shardlm.observe.metrics import MetricsLogger, Throughput, memory_gib, peak_flops
from shardlm.parallel.compile import apply_compile
from shardlm.parallel.dims import ParallelDims, dp_rank
from shardlm.parallel.fsdp import apply_fsdp, clip_grad_norm_, mp_policy, shard_view
from shardlm.quant.fp8 import (
    apply_fp8,
    check_fp8_hardware,
    fp8_all_gather,
    precompute_fp8_scales,
)
from shardlm.train.optim import build_lr_scheduler, build_optimizer
from shardlm.train.preemption import Preemption


def hf_dir(cfg: Config) -> Path | None:
    """The directory model.init_from names (`hf:/path`), or None for a random init."""
    return Path(cfg.model.init_from[3:]) if cfg.model.init_from else None


def tokenizer_spec(cfg: Config) -> str:
    """data.tokenizer with `auto` resolved: the HF model's own tokenizer when there is one, else bytes."""
    if cfg.data.tokenizer != "auto":
        return cfg.data.tokenizer
    d = hf_dir(cfg)
    return str(d) if d is not None and (d / "tokenizer.json").is_file() else "bytes"


def build_model_config(cfg: Config, tokenizer_vocab: int) -> ModelConfig:
    """The preset, with any model.* overrides, its RoPE table sized to data.seq_len."""
    overrides = {k: v for k, v in dataclasses.asdict(cfg.model).items()
                 if k not in ("preset", "init_from") and v is not None}
    if hf_dir(cfg) is not None:
        from shardlm.hf_io import read_hf_config

        if overrides:
            raise ConfigError(f"model.{next(iter(overrides))} cannot change the shape of a model loaded with "
                              "model.init_from; drop the override")
        base, _ = read_hf_config(hf_dir(cfg))
    else:
        try:
            base = get_preset(cfg.model.preset)
        except KeyError as e:
            raise ConfigError(f"model.preset: {e.args[0]}") from None
    if ({"dim", "n_heads"} & overrides.keys()) and base.head_dim == base.dim // base.n_heads:
        overrides["head_dim"] = None  # derived, not set by the preset: derive it again (Qwen3's stays)
    if "n_heads" in overrides and "n_kv_heads" not in overrides and base.n_kv_heads == base.n_heads:
        overrides["n_kv_heads"] = None  # plain MHA stays MHA
    try:
        mc = dataclasses.replace(base, **overrides, max_seq_len=cfg.data.seq_len)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    if tokenizer_vocab > mc.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer_vocab} tokens but the model's vocab_size is {mc.vocab_size}; "
                          f"set --model.vocab_size={tokenizer_vocab} or use a matching tokenizer")
    return mc


def build_model(mc: ModelConfig, mesh, cfg: Config, device: torch.device) -> Transformer:
    """Meta-device build -> LoRA/freeze -> AC -> compile -> fully_shard -> to_empty -> init or HF load.

    No rank ever holds the whole model: each materialises and fills only its own shards.
    """
    t, lo = cfg.train, cfg.lora
    with torch.device("meta"):
        model = Transformer(mc)
    if lo.rank > 0:
        from shardlm.lora import apply_lora

        try:
            apply_lora(model, lo.rank, lo.alpha, lo.dropout, lo.targets, train_embeddings=lo.train_embeddings,
                       train_norms=lo.train_norms)
        except ValueError as e:
            raise ConfigError(f"lora.targets: {e}") from None
    if t.mixed_precision == "fp8":
        check_fp8_hardware(device, t.fp8_emulate)
        apply_fp8(model, t.fp8_recipe, t.fp8_emulate, fp8_all_gather(t.fp8_recipe, device))
    if t.ac != "none":
        from shardlm.parallel.ac import apply_ac

        apply_ac(model, t.ac, every=t.ac_every)
    if t.compile:
        apply_compile(model, t.compile_backend)
    apply_fsdp(model, mesh, mp_policy(t.mixed_precision, t.reduce_dtype), cfg.parallel.reshard_after_forward,
               cpu_offload=t.cpu_offload)
    model.to_empty(device="cpu" if t.cpu_offload else device)
    if hf_dir(cfg) is None:
        model.init_weights(seed=t.seed, shard_view=shard_view)  # LoRA adapters start here too (B = 0)
    else:
        from shardlm.hf_io import load_hf_weights
        from shardlm.lora import is_lora_param

        # The HF files hold every base weight (load_hf_weights errors on any missing): draw only the
        # adapters, not 70B numbers that the load overwrites.
        model.init_weights(seed=t.seed, shard_view=shard_view, only=is_lora_param)
        load_hf_weights(model, hf_dir(cfg))
    return model


def sidecar_files(cfg: Config, mc: ModelConfig) -> dict[str, str]:
    """What a checkpoint needs beside its tensors to be exported on its own (`shardlm convert`)."""
    files = {"model_config.json": json.dumps(dataclasses.asdict(mc), indent=1)}
    lo = cfg.lora
    if lo.rank > 0:
        files["lora_config.json"] = json.dumps({"rank": lo.rank, "alpha": lo.alpha, "dropout": lo.dropout,
                                                "targets": lo.targets, "adapters_only": lo.adapters_only,
                                                "base": cfg.model.init_from}, indent=1)
    d = hf_dir(cfg)
    if d is not None:
        files["hf_source.json"] = json.dumps({"init_from": cfg.model.init_from,
                                              "tokenizer": tokenizer_spec(cfg)}, indent=1)
    return files


def prepare_output_dir(cfg: Config, is_rank0: bool) -> Path:
    """Create the run directory and write the resolved config."""
    out = Path(cfg.train.output_dir)
    if is_rank0:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"train.output_dir {str(out)!r} cannot be created: {e.strerror}") from None
        (out / "config.toml").write_text(cfg.to_toml())
    return out


def prepare_metrics_file(out: Path, resumed_step: int | None) -> None:
    """Fresh run: keep an earlier metrics.jsonl aside. Resumed: drop the records after the checkpoint
    (the resumed run logs those steps again)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return
    if resumed_step is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        path.rename(out / f"metrics.{stamp}.jsonl")
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= resumed_step]
    path.write_text("".join(line + "\n" for line in keep))


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        # Everything that can be wrong with the config fails here, before any collective.
        self.dims = ParallelDims(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, launched_world_size())
        self.tokenizer = load_tokenizer(tokenizer_spec(cfg))
        self.model_cfg = build_model_config(cfg, self.tokenizer.vocab_size)
        self.files = resolve_files(cfg.data.path)
        self.env = init_distributed(cfg.train.device)
        self.is_rank0 = self.env.rank == 0
        # From here on a SIGTERM is a request to checkpoint and stop, honoured after the next step.
        self.preemption = Preemption(cfg.checkpoint.preempt_grace_s, self.log)
        if self.is_rank0 and (warning := restart_store_warning()):
            print(warning, file=sys.stderr, flush=True)
        torch.manual_seed(cfg.train.seed)
        self.mesh = self.dims.build_mesh(self.env.device.type)
        self.output_dir = prepare_output_dir(cfg, self.is_rank0)
        self.loader, self.data_meta = self.build_data()
        self.model = build_model(self.model_cfg, self.mesh, cfg, self.env.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.fp8_all_gather = cfg.train.mixed_precision == "fp8" and fp8_all_gather(cfg.train.fp8_recipe,
                                                                                       self.env.device)
        self.optimizer = build_optimizer(self.model, cfg.train, self.env.device)
        self.checkpointer = Checkpointer(cfg.checkpoint, self.checkpoint_dir, self.env.rank, log=self.log,
                                         trainable_only=cfg.lora.adapters_only)
        self.checkpointer.sidecar_files.update(sidecar_files(cfg, self.model_cfg))
        self.step = 0
        self.step = self.resume()
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.train, last_step=self.step)
        if self.is_rank0:
            prepare_metrics_file(self.output_dir, self.step if self.resumed_from else None)
        self.metrics = MetricsLogger(self.output_dir, cfg.train.steps, self.is_rank0, cfg.metrics.progress_bar,
                                     cfg.metrics.tensorboard, start_step=self.step)

    @property
    def checkpoint_dir(self) -> Path:
        c = self.cfg.checkpoint
        return Path(c.dir) if c.dir else self.output_dir / "checkpoints"

    def log(self, line: str) -> None:
        """A line on rank 0 (through the progress bar once there is one)."""
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.write(line)
        elif self.is_rank0:
            print(line, flush=True)

    # -- checkpoint state ------------------------------------------------------------------------
    def trainer_state(self) -> dict[str, torch.Tensor]:
        """What the checkpoint holds besides model and optimizer (tensors, so DCP needs no pickles)."""
        state = {"step": torch.tensor(self.step), "samples_seen": torch.tensor(self.loader.samples_seen),
                 "rng_cpu": torch.get_rng_state()}
        if self.env.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.env.device)
        return state

    def resume(self) -> int:
        """Load the checkpoint that checkpoint.resume names (or auto-finds); returns the step to start at."""
        state = self.trainer_state()
        self.resumed_from = self.checkpointer.load(self.model, self.optimizer, state)
        if self.resumed_from is None:
            return 0
        self.loader.load_state_dict({"samples_seen": int(state["samples_seen"])})
        torch.set_rng_state(state["rng_cpu"])
        if "rng_cuda" in state:
            torch.cuda.set_rng_state(state["rng_cuda"], self.env.device)
        step = int(state["step"])
        self.log(f"checkpoint: resumed from {self.resumed_from} at step {step} "
                 f"({self.loader.samples_seen} samples consumed)")
        return step

    def save(self, final: bool = False, blocking: bool = False) -> None:
        model_only = final and self.cfg.checkpoint.model_only
        self.checkpointer.save(self.step, self.model, None if model_only else self.optimizer, self.trainer_state(),
                               blocking=blocking or final)

    def build_data(self):
        d, t = self.cfg.data, self.cfg.train
        if d.format == "sft":
            from shardlm.data.sft import build_sft_loader

            spec = tokenizer_spec(self.cfg)
            tok_dir = None if spec == "bytes" else (Path(spec) if Path(spec).is_dir() else Path(spec).parent)
            loader, stats = build_sft_loader(
                self.files, self.tokenizer, tok_dir, seq_len=d.seq_len, micro_batch_size=t.micro_batch_size,
                grad_accum=t.grad_accum, dp_rank=dp_rank(self.mesh), dp_size=self.dims.dp, seed=t.seed,
                shuffle=d.shuffle, pack=d.pack)
            self.log(f"sft data: {stats['samples']} samples ({stats['truncated']} truncated to data.seq_len, "
                     f"{stats['dropped']} dropped with no answer left), {stats['loss_tokens']} loss tokens, "
                     f"{stats['template']} template, {'packed' if d.pack else 'padded'} into {loader.n_windows} rows")
            return loader, stats
        cache = Path(d.cache_dir) if d.cache_dir else default_cache_dir()
        return build_loader(self.files, self.tokenizer, d.text_field, cache, seq_len=d.seq_len,
                            micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum,
                            dp_rank=dp_rank(self.mesh), dp_size=self.dims.dp, seed=t.seed, shuffle=d.shuffle,
                            is_builder=self.env.local_rank == 0, barrier=dist.barrier)

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                   stop_requested: bool = False) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """One optimizer step over `grad_accum` micro-batches -> (global mean loss, grad norm, stop?).

        The loss is a mean over every target token of the global batch: each rank sums its token
        losses and divides by the global token count (x dp, since FSDP averages gradients over dp).
        Gradients are reduce-scattered only after the last micro-batch. A rank's stop request
        (SIGTERM) rides on the same all-reduce, so all ranks stop after the same step.
        """
        dev = self.env.device
        # Counted on the host and reduced over gloo (the process group has a CPU backend on GPUs
        # too): no device sync, and the scale is a plain float.
        counts = torch.tensor([float(sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)), float(stop_requested)])
        dist.all_reduce(counts)
        n_tokens, stop = counts.tolist()
        scale = self.dims.dp / n_tokens
        loss_sum = torch.zeros((), device=dev)
        for k, (x, y) in enumerate(batches):
            if len(batches) > 1:
                self.model.set_requires_gradient_sync(k == len(batches) - 1)
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            logits = self.model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
            (loss * scale).backward()
            loss_sum += loss.detach()
        grad_norm = clip_grad_norm_(self.params, self.cfg.train.grad_clip)
        self.optimizer.step()
        if self.fp8_all_gather:
            precompute_fp8_scales(self.model)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / n_tokens, grad_norm, stop > 0

    def train(self) -> list[dict]:
        """Run to train.steps (or until SIGTERM); returns the records logged by this process."""
        t, c, log_every = self.cfg.train, self.cfg.checkpoint, self.cfg.metrics.log_every
        tokens_per_step = self.loader.global_batch * self.cfg.data.seq_len
        meter = Throughput(self.model_cfg.flops_per_token(self.cfg.data.seq_len), peak_flops(self.env.device),
                           self.env.world_size)
        self.announce(tokens_per_step)
        if self.step >= t.steps:
            self.log(f"nothing to do: the checkpoint is at step {self.step} and train.steps={t.steps}; "
                     "raise train.steps to train further")
        records, start, stopped = [], time.perf_counter(), False
        while self.step < t.steps and not stopped:
            lr = self.scheduler.get_last_lr()[0]
            loss, grad_norm, stopped = self.train_step(self.loader.next_step(), self.preemption.requested)
            self.step += 1
            meter.add(tokens_per_step)
            self.checkpointer.poll()
            log_now = self.step % log_every == 0 or self.step == t.steps
            save_now = (stopped or (self.step == t.steps and c.save_final)
                        or (c.interval > 0 and self.step % c.interval == 0))
            loss_v = None
            if log_now or save_now:
                dist.all_reduce(loss)  # each rank holds its share of the global mean
                loss_v = loss.item()
                if not math.isfinite(loss_v):  # checked before any save: never checkpoint a NaN
                    raise TrainingError(f"loss is {loss_v} at step {self.step}; lower train.lr, enable "
                                        "train.grad_clip or use train.mixed_precision=fp32")
            if log_now:
                tps, mfu = meter.measure()
                rec = {"step": self.step, "loss": loss_v, "lr": lr, "grad_norm": grad_norm.item(),
                       "tokens_per_sec": tps, "mfu": mfu, "mem_gib": memory_gib(self.env.device),
                       "elapsed_s": time.perf_counter() - start}
                records.append(rec)
                self.metrics.log(rec)
            self.metrics.advance(loss_v)
            if save_now:
                self.save(final=self.step == t.steps, blocking=stopped)
        self.checkpointer.wait()
        if stopped:
            self.log(f"preempted (SIGTERM): checkpoint at step {self.step} saved; exiting cleanly")
        self.finish(records, time.perf_counter() - start, sample=not stopped)
        return records

    def announce(self, tokens_per_step: int) -> None:
        d, mc, m = self.cfg.data, self.model_cfg, self.data_meta
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.mesh.mesh_dim_names, self.mesh.shape))
        self.metrics.write(
            f"shardlm: {self.env.world_size} rank(s) on {self.env.device.type} ({self.env.backend}), mesh {mesh} | "
            f"model {self.cfg.model.init_from or self.cfg.model.preset}: {mc.num_params() / 1e6:.2f}M params"
            f"{self.trainable_note()}, {self.precision_note()} | "
            f"data {len(self.files)} files, {m['tokens'] / 1e6:.2f}M tokens, {self.loader.n_windows} sequences of "
            f"{d.seq_len} | global batch {self.loader.global_batch} seqs = {tokens_per_step} tokens/step")

    def precision_note(self) -> str:
        """``bf16``, or ``fp8 tensorwise (28 float8 linears, float8 all-gather)`` and the like."""
        t = self.cfg.train
        if t.mixed_precision != "fp8":
            return t.mixed_precision
        n = sum(type(m).__name__ == "Float8Linear" for m in self.model.modules())
        extra = ", float8 all-gather" if self.fp8_all_gather else ""
        return f"fp8 {t.fp8_recipe}{' emulated' if t.fp8_emulate else ''} ({n} float8 linears{extra})"

    def trainable_note(self) -> str:
        """`` (3.1% trainable: LoRA r=8)`` when not every parameter trains."""
        total = sum(p.numel() for p in self.model.parameters())
        trainable = sum(p.numel() for p in self.params)
        if trainable == total:
            return ""
        lora = f": LoRA r={self.cfg.lora.rank}" if self.cfg.lora.rank else ""
        return f" ({trainable / 1e6:.3f}M = {100 * trainable / total:.1f}% trainable{lora})"

    def finish(self, records: list[dict], elapsed: float, sample: bool = True) -> None:
        t = self.cfg.train
        if records:
            self.metrics.write(f"done: {self.step} steps in {elapsed:.1f}s, loss {records[0]['loss']:.3f} -> "
                               f"{records[-1]['loss']:.3f}; outputs in {self.output_dir}/ (config.toml, metrics.jsonl)")
        if sample and t.sample_tokens > 0:
            ids = generate(self.model, self.tokenizer.encode(t.sample_prompt), t.sample_tokens,
                           self.cfg.data.seq_len, seed=t.seed, device=self.env.device)
            self.metrics.write("sample:\n" + self.tokenizer.decode(ids))
        self.metrics.close()

    def close(self) -> None:
        """Finish the in-flight save, release the model and every process group; the end of a Trainer."""
        self.preemption.uninstall()
        self.checkpointer.close()
        # The FSDP state inside the model holds the process groups: drop it so that their threads end
        # here and not during interpreter shutdown (see shutdown_distributed).
        self.model = self.optimizer = self.scheduler = self.params = None
        shutdown_distributed()
