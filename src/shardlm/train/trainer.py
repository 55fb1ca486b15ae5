"""Trainer: build the mesh, model, optimizer and data from a Config; run the loop."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardlm._torch_compat import float8_linear_class
from shardlm.build import build_model, build_model_config, uses_fp8_all_gather
from shardlm.checkpoint import Checkpointer
from shardlm.checkpoint.meta import CheckpointMeta
from shardlm.config import Config
from shardlm.data import build_loader, load_tokenizer, resolve_files
from shardlm.data.loader import IGNORE_INDEX
from shardlm.distributed.env import init_distributed, launched_world_size, restart_store_warning, shutdown_distributed
from shardlm.errors import ConfigError, TrainingError
from shardlm.generate import generate
from shardlm.observe.metrics import MetricsLogger, Throughput, peak_flops, read_and_reset_peak_memory_gib
from shardlm.parallel.dims import ParallelDims, dp_rank
from shardlm.parallel.fsdp import clip_grad_norm_
from shardlm.quant.fp8 import precompute_fp8_scales
from shardlm.train.optim import build_lr_scheduler, build_optimizer
from shardlm.train.preemption import Preemption
from shardlm.train.state import TrainState
from shardlm.train.step import Batch, forward_backward


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


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's share of the global mean loss (all-reduce to get it)
    grad_norm: float  # global, before clipping
    stop: bool  # some rank was asked to stop (SIGTERM)
    nonfinite: str | None  # what went bad (the update was not applied), or None


def nonfinite_report(loss_sum: torch.Tensor, params: list) -> str:
    """Which ranks saw a non-finite loss or local gradient (the exceptional path: one all-gather)."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    grads_ok = all(bool(torch.isfinite(g).all()) for g in grads)
    mine = torch.tensor([float(bool(torch.isfinite(loss_sum))), float(grads_ok)])
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    bad_loss = [r for r, v in enumerate(every) if not v[0]]
    bad_grad = [r for r, v in enumerate(every) if not v[1]]

    def ranks(rs: list[int]) -> str:
        return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"

    if bad_loss:
        return f"loss is not finite on {ranks(bad_loss)}"
    if bad_grad:
        return f"gradients are not finite on {ranks(bad_grad)} (loss finite on every rank)"
    return "the gradient norm overflowed (every loss and gradient finite)"


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        # Everything that can be wrong with the config fails here, before any collective.
        self.dims = ParallelDims(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, launched_world_size())
        self.tokenizer = load_tokenizer(cfg.tokenizer_spec())
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
        self.model = build_model(cfg, self.model_cfg, self.mesh, self.env.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.fp8_all_gather = uses_fp8_all_gather(cfg, self.env.device)
        self.skipped_in_row = self.skipped_total = 0
        self.optimizer = build_optimizer(self.model, cfg.train, self.env.device)
        self.state = TrainState(self.loader, self.env.device)
        self.checkpointer = Checkpointer(cfg.checkpoint, self.checkpoint_dir, self.env.rank, self.model,
                                         self.optimizer, {"trainer": self.state}, log=self.log,
                                         trainable_only=cfg.lora.adapters_only,
                                         meta=CheckpointMeta.from_config(cfg, self.model_cfg))
        self.resumed_from = self.checkpointer.load()
        if self.resumed_from is not None:
            self.log(f"checkpoint: resumed from {self.resumed_from} at step {self.step} "
                     f"({self.loader.samples_seen} samples consumed)")
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

    @property
    def step(self) -> int:
        """Optimizer steps done (the checkpointed TrainState's)."""
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    def save(self, final: bool = False, blocking: bool = False) -> None:
        self.checkpointer.save(self.step, final=final, blocking=blocking)

    def build_data(self):
        return build_loader(self.cfg, self.tokenizer, dp_rank(self.mesh), self.dims.dp,
                            is_builder=self.env.local_rank == 0, barrier=dist.barrier, log=self.log, files=self.files)

    def train_step(self, batches: list[Batch], stop_requested: bool = False) -> StepResult:
        """One optimizer step over `grad_accum` micro-batches (see `forward_backward` for the loss).

        Before the optimizer runs, the guard: the local loss sum rides on the grad-norm all-reduce,
        so a NaN/inf loss or gradient on any rank makes the norm non-finite on every rank, and all
        of them skip (or stop) together. A rank's stop request (SIGTERM) rides on the token-count
        all-reduce, so all ranks stop after the same step.
        """
        t = self.cfg.train
        # Counted on the host and reduced over gloo (the process group has a CPU backend on GPUs
        # too): no device sync, and the scale is a plain float.
        counts = torch.tensor([float(sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)), float(stop_requested)])
        dist.all_reduce(counts)
        n_tokens, stop = counts.tolist()
        loss_sum = forward_backward(self.model, batches, self.dims.dp / n_tokens, self.env.device, t.grad_sync,
                                    self.dims.hsdp)
        norm = clip_grad_norm_(self.params, t.grad_clip, flag=loss_sum)
        grad_norm = norm.item()  # the step's one host read: the guard decides before the optimizer does
        bad = None if math.isfinite(grad_norm) else nonfinite_report(loss_sum, self.params)
        if bad is None:
            self.optimizer.step()
            if self.fp8_all_gather:
                precompute_fp8_scales(self.model)
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_sum / n_tokens, grad_norm, stop > 0, bad)

    def on_nonfinite(self, bad: str) -> None:
        """train.nonfinite: stop with one line, or count the skip (and stop after too many in a row)."""
        t = self.cfg.train
        where = f"optimizer step {self.step + 1}: {bad}"
        if t.nonfinite == "stop":
            raise TrainingError(f"non-finite {where}; the update was not applied and the last checkpoint stands. "
                                "Lower train.lr, set train.grad_clip, use train.mixed_precision=fp32, or "
                                "train.nonfinite=skip to drop such steps")
        self.skipped_in_row += 1
        self.skipped_total += 1
        self.log(f"skipped non-finite {where} ({self.skipped_in_row} in a row, {self.skipped_total} in all; "
                 "no update, the batch is consumed)")
        if self.skipped_in_row >= t.max_skipped_steps:
            raise TrainingError(f"{self.skipped_in_row} non-finite steps in a row (train.max_skipped_steps="
                                f"{t.max_skipped_steps}); the last checkpoint stands. Lower train.lr or check the data")

    def train(self) -> list[dict]:
        """Run to train.steps optimizer steps (or until SIGTERM); returns the records logged by this process."""
        t, log_every = self.cfg.train, self.cfg.metrics.log_every
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
            res = self.train_step(self.loader.next_step(), self.preemption.requested)
            stopped = res.stop
            meter.add(tokens_per_step)
            self.checkpointer.poll()
            if res.nonfinite is not None:
                self.on_nonfinite(res.nonfinite)
                if stopped:  # SIGTERM during a skipped step: checkpoint what there is
                    self.save(blocking=True)
                continue
            self.skipped_in_row = 0
            self.step += 1
            log_now = self.step % log_every == 0 or self.step == t.steps
            save_now = self.checkpointer.due(self.step, final=self.step == t.steps, stopped=stopped)
            loss_v = None
            if log_now or save_now:
                dist.all_reduce(res.loss)  # each rank holds its share of the global mean
                loss_v = res.loss.item()
            if log_now:
                tps, mfu = meter.measure()
                rec = {"step": self.step, "loss": loss_v, "lr": lr, "grad_norm": res.grad_norm,
                       "tokens_per_sec": tps, "mfu": mfu, "mem_gib": read_and_reset_peak_memory_gib(self.env.device),
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
            f"data {len(self.files)} files, {m['tokens'] / 1e6:.2f}M tokens, {self.loader.n_rows} sequences of "
            f"{d.seq_len} | global batch {self.loader.global_batch} seqs = {tokens_per_step} tokens/step")

    def precision_note(self) -> str:
        """``bf16``, or ``fp8 tensorwise (28 float8 linears, float8 all-gather)`` and the like."""
        t = self.cfg.train
        if t.mixed_precision != "fp8":
            return t.mixed_precision
        float8 = float8_linear_class()
        n = sum(isinstance(m, float8) for m in self.model.modules()) if float8 else 0
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
            skipped = f" ({self.skipped_total} non-finite steps skipped)" if self.skipped_total else ""
            self.metrics.write(f"done: {self.step} steps in {elapsed:.1f}s{skipped}, loss {records[0]['loss']:.3f} -> "
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


def train(cfg: Config) -> list[dict]:
    """Build a Trainer from `cfg`, run it to the end and release everything, also after an error."""
    trainer = None
    try:
        trainer = Trainer(cfg)
        return trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        else:  # the Trainer failed part-way: still free the process group it may have joined
            shutdown_distributed()
