"""Trainer: build the mesh, model, optimizer and data from a Config; run the loop."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardlm._torch_compat import float8_linear_class
from shardlm.build import base_dtype, build_model, build_model_config, model_state_bytes, uses_fp8_all_gather
from shardlm.checkpoint import Checkpointer
from shardlm.checkpoint.manager import remove_partials
from shardlm.checkpoint.lineage import current_lineage, tokenizer_fingerprint
from shardlm.checkpoint.meta import CheckpointMeta
from shardlm.config import Config
from shardlm.data import MixtureLoader, build_loader, load_tokenizer, open_stores, source_list
from shardlm.data.loader import IGNORE_INDEX, mixture_val_stores, open_val_store
from shardlm.data.store import is_store
from shardlm.models.llama import document_attention_backend
from shardlm.distributed.check import start_problems
from shardlm.distributed.nccl import apply_env
from shardlm.distributed.preflight import StepTimes, preflight, step_time_slots
from shardlm.distributed.watchdog import Watchdog, heartbeat_store, install_test_stall, launcher_of, set_timeouts
from shardlm.distributed.env import device_type, init_distributed, restart_store_warning, shutdown_distributed
from shardlm.errors import (ConfigError, DataError, Interrupted, PreflightError, ShardlmError, StorageError,
                            TrainingError)
from shardlm.generate import check_context, generate, prompt_ids
from shardlm.eval.validation import MixtureValidation, Validator, best_logged
from shardlm.observe.metrics import MetricsLogger, Throughput, peak_flops, read_and_reset_peak_memory
from shardlm.observe.profiler import PhaseTimer, StepProfiler
from shardlm.observe.wandb_log import WandbLogger
from shardlm.parallel.dims import device_memory_bytes, dp_rank, launch_topology, resolve_dims
from shardlm.parallel.fsdp import DTYPES, clip_grad_norm_, settle_auto_reshard
from shardlm.quant.fp8 import precompute_fp8_scales
from shardlm.resolve import tokenizer_spec
from shardlm.train.optim import build_lr_scheduler, build_optimizer, extended_anchor
from shardlm.train.preemption import Preemption
from shardlm.train.rundir import RunLock, check_writable, prepare_metrics_file, write_config
from shardlm.train.state import TrainState
from shardlm.train.sdpa import sdpa_backends_for
from shardlm.train.step import Batch, forward_backward


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's share of the global mean loss (all-reduce to get it)
    grad_norm: float  # global, before clipping
    stop: bool  # some rank was asked to stop (SIGTERM or Ctrl-C)
    interrupted: bool  # ... by Ctrl-C: the run ends with exit 130, not 0
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


class BusyTime:
    """A rank's busy host time per step: from leaving one step's token-count all-reduce to arriving at the
    next one (data loading, forward, backward, optimizer: all but the wait for the slowest rank), averaged
    over the steps since the last `slots` (see distributed/preflight.StepTimes)."""

    def __init__(self) -> None:
        self.left: float | None = None
        self.total, self.n = 0.0, 0

    def arrive(self) -> None:
        if self.left is not None:
            self.total += time.perf_counter() - self.left
            self.n += 1

    def leave(self) -> None:
        self.left = time.perf_counter()

    def slots(self, rank: int, world_size: int) -> list[float]:
        """This rank's mean busy time in its slot of a world-sized vector (then start a new interval)."""
        mean = self.total / self.n if self.n else 0.0
        self.total, self.n = 0.0, 0
        return step_time_slots(mean, rank, world_size)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        # NCCL and torch read these when the process group (and the CUDA allocator) starts: first thing.
        env_report = apply_env(cfg.env.preset, cfg.env.set_, Path(cfg.train.output_dir))
        # Everything that can be wrong with the config fails here, before any collective.
        topo = launch_topology()
        self.tokenizer_spec = tokenizer_spec(cfg)  # resolved once: the data, the checkpoints and the logs take it
        self.tokenizer = load_tokenizer(self.tokenizer_spec)
        warnings: list[str] = []
        self.model_cfg = build_model_config(cfg, self.tokenizer.vocab_size, warn=warnings.append)
        dev_type = device_type(cfg.train.device)
        if problems := start_problems(os.environ, cuda=dev_type == "cuda"):  # before a long data preparation
            raise ConfigError(str(problems[0]))
        self.dims, self.dims_reason = resolve_dims(
            cfg.parallel, topo, lambda: model_state_bytes(cfg, self.model_cfg, dev_type),
            device_memory_bytes(dev_type, int(os.environ.get("LOCAL_RANK", "0")), topo.ranks_per_node))
        # Data comes from token stores (text or SFT); raw files are prepared into one now, before the process
        # group starts (no collective waits on it, so no timeout can fire), once per shared filesystem.
        first = os.environ.get("RANK", "0") == "0"
        say = lambda line: print(line, flush=True)  # noqa: E731
        quiet = say if first else (lambda line: None)
        self.stores = open_stores(cfg, self.tokenizer, log=say, wait_log=quiet, tokenizer_spec=self.tokenizer_spec)
        self.val_store = open_val_store(cfg, self.tokenizer, log=say, wait_log=quiet,
                                        tokenizer_spec=self.tokenizer_spec)
        self.val_sources = mixture_val_stores(cfg, log=say if first else (lambda line: None))
        e = cfg.eval
        if self.val_store is None and not self.val_sources and e.interval:
            how = ("mix token stores prepared with --val-fraction / --val (each source's val/ is used)"
                   if cfg.data.sources else "train on a store prepared with --val-fraction / --val")
            raise ConfigError(f"eval.interval={e.interval} needs validation data: set data.val_path (a store or "
                              f"files), or {how}; or eval.interval=0")
        if first and (self.val_store is not None or self.val_sources):
            when = (f"every {e.interval} steps" if e.interval else "") + (" and " if e.interval and e.at_end else "") \
                + ("at the end" if e.at_end else "")
            for store in [self.val_store] if self.val_store is not None else [v for _, v in self.val_sources]:
                say(f"data: validation store {store.path}: {store.documents:,} documents, "
                    f"{store.n_tokens:,} tokens; evaluated {when}")
        self.env = init_distributed(cfg.train.device, cfg.parallel.init_timeout_s)
        self.is_rank0 = self.env.rank == 0
        self.topo = topo
        # From here a dead or stalled peer ends this rank with one line (exit 8), never a hang.
        # And so does a launcher that is gone (an orphaned rank stops, exit 8).
        ck_dir = checkpoint_dir(cfg)
        self.watchdog = Watchdog(self.env.rank, self.env.world_size, heartbeat_store(), cfg.parallel.init_timeout_s,
                                 local_world_size=topo.ranks_per_node,
                                 backend="nccl" if self.env.device.type == "cuda" else "gloo",
                                 tail=lambda: stands(ck_dir), launcher_pid=launcher_of()).start()
        install_test_stall(self.watchdog, os.environ.get("SHARDLM_TEST_STALL"))
        # From here on a SIGTERM is a request to checkpoint and stop, honoured after the next step
        # (and so is Ctrl-C, during the training loop).
        self.preemption = Preemption(cfg.checkpoint.preempt_grace_s, self.log, self.interrupted_line, self.is_rank0)
        if self.is_rank0:
            env_lines = env_report.lines()
            for line in env_lines:
                if ": warning: " not in line:
                    self.log(line)
            warnings = [line for line in env_lines if ": warning: " in line] + warnings
            for warning in [*warnings, restart_store_warning()]:
                if warning:
                    print(warning, file=sys.stderr, flush=True)
        torch.manual_seed(cfg.train.seed)
        self.output_dir = Path(cfg.train.output_dir)
        self.locks: list[RunLock] = []
        try:
            with self.watchdog.guard("setup: mesh"):
                self.mesh = self.dims.build_mesh(self.env.device.type)
                # The mesh's groups take the backend's default timeout, not init_process_group's: set them.
                set_timeouts(self.mesh, self.watchdog.pg_timeout_s(cfg.parallel.init_timeout_s))
                self.run_preflight()
                self.locks = self.lock_run_folders()
                self.build()
        except BaseException:
            self.release_locks()  # a start that failed leaves the folder free for the next one
            self.preemption.uninstall()
            self.watchdog.stop()
            raise

    def build(self) -> None:
        """Data, model, optimizer, checkpointer and resume, schedule, run files: after the folder lock."""
        cfg, wd = self.cfg, self.watchdog
        wd.enter("setup: data")
        self.loader, self.data_meta = self.build_data()
        self.check_mixture()
        backend, why = document_attention_backend(self.env.device)
        self.attention_note = f"{backend}: {why}"
        precision = cfg.train.precision(self.env.device.type)
        self.sdpa_backends, self.sdpa_note = sdpa_backends_for(  # an unusable explicit kernel stops here
            cfg.train.attention_backend, self.env.device, DTYPES["bf16" if precision == "fp8" else precision],
            self.model_cfg.head_dim, dense_mask=cfg.data.document_mask and backend == "sdpa-mask")
        wd.enter("setup: model")
        self.model = build_model(cfg, self.model_cfg, self.mesh, self.env.device)
        wd.attach(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.check_writable()
        self.fp8_all_gather = uses_fp8_all_gather(cfg, self.env.device)
        self.skipped_in_row = self.skipped_total = 0
        self.busy, self.rank_step_times = BusyTime(), None
        self.step_times = StepTimes(self.env.world_size, self.topo.ranks_per_node, min_excess_s=0.01)
        self.optimizer = build_optimizer(self.model, cfg.train, self.env.device)
        self.state = TrainState(self.loader, self.env.device)
        self.checkpointer = Checkpointer(cfg.checkpoint, self.checkpoint_dir, self.env.rank, self.model,
                                         self.optimizer, {"trainer": self.state}, log=self.log,
                                         trainable_only=cfg.lora.adapters_only,
                                         meta=CheckpointMeta.from_config(cfg, self.model_cfg, self.tokenizer_spec),
                                         info=self.run_info())
        wd.enter("checkpoint load")
        self.resumed_from = self.checkpointer.load()
        wd.enter("setup")
        self.started_at = self.step
        if self.resumed_from is not None:
            self.log(f"checkpoint: resumed from {self.resumed_from} at step {self.step} "
                     f"({self.loader.samples_seen} samples consumed)")
            was = getattr(self.optimizer, "resumed_state_dtype", None)
            if was is not None and was != cfg.train.optimizer_state_dtype:
                self.log(f"resume: the checkpoint's AdamW moments were {was}; converted to "
                         f"train.optimizer_state_dtype={cfg.train.optimizer_state_dtype}")
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.train, last_step=self.step, anchor=self.lr_anchor())
        self.checkpointer.info["schedule"] = {"steps": cfg.train.steps, "anchor": self.scheduler.anchor}
        def run_files() -> None:  # written once the run is known to start: a failed retry leaves the last one
            if kept := write_config(self.output_dir, cfg.to_toml()):
                self.log(f"config: this start's config.toml differs from the last one, kept as {kept.name}")
            prepare_metrics_file(self.output_dir, self.step if self.resumed_from else None, log=self.log)

        self.on_rank0(run_files)
        self.metrics = MetricsLogger(self.output_dir, cfg.train.steps, self.is_rank0, cfg.metrics.progress_bar,
                                     cfg.metrics.tensorboard, start_step=self.step)
        wd.enter("setup: eval")
        self.validator = None
        if not (cfg.eval.interval or cfg.eval.at_end):
            pass  # never evaluated
        elif self.val_store is not None:
            self.validator = Validator(cfg, self.val_store, self.tokenizer, dp_rank(self.mesh), self.dims.dp,
                                       self.env.device)
        elif self.val_sources:
            self.validator = MixtureValidation(cfg, [v for _, v in self.val_sources], [n for n, _ in self.val_sources],
                                               self.tokenizer, dp_rank(self.mesh), self.dims.dp, self.env.device)
        # the best val_loss of the run so far (a resume carries the one logged before it)
        self.best_val = best_logged(self.output_dir / "metrics.jsonl", self.step) \
            if self.resumed_from is not None and self.is_rank0 else None
        m, pr = cfg.metrics, cfg.profile
        self.profiler = StepProfiler(self.output_dir, pr.start_step, pr.steps, self.env.rank, self.env.device,
                                     log=self.log, memory=pr.memory) if pr.enabled else None
        sync = torch.cuda.synchronize if self.env.device.type == "cuda" and m.phase_sync else None
        self.timer = PhaseTimer(sync=sync)
        self.wandb = None
        if m.wandb:
            def wandb_logger(rank0: bool) -> WandbLogger:
                return WandbLogger(self.output_dir, cfg.to_dict(), m.wandb_project, m.wandb_run_name or None,
                                   enabled=rank0, resumed=self.resumed_from is not None, log=self.log)

            # rank 0's W&B start may fail (no login): every rank stops with its line, none reports a peer gone
            made = self.on_rank0(lambda: wandb_logger(True))
            self.wandb = made if self.is_rank0 else wandb_logger(False)

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on rank 0 (a setup step only rank 0 does); a shardlm error it raises stops every rank with
        rank 0's line and exit code (the others would otherwise wait in their next collective and report rank 0
        as gone). Every rank must call it at the same point."""
        error, result = [None], None
        if self.is_rank0:
            try:
                result = fn()
            except ShardlmError as e:
                error = [(type(e).__name__, str(e))]
        dist.broadcast_object_list(error, src=0)  # our own ranks' objects: nothing untrusted is unpickled
        if error[0] is not None:
            import shardlm.errors as errors

            kind, line = error[0]
            cls = getattr(errors, kind, ShardlmError)
            raise (cls if isinstance(cls, type) and issubclass(cls, ShardlmError) else ShardlmError)(line)
        return result

    def run_preflight(self) -> None:
        """parallel.preflight: every rank times a GEMM and an all-reduce per mesh dimension; a slow one is named
        (and with `strict` the run stops, on every rank alike, before anything is written)."""
        p = self.cfg.parallel.preflight
        if not (p is True or p == "strict" or (p == "auto" and self.topo.nodes > 1)) or self.env.world_size == 1:
            return
        self.watchdog.enter("preflight")
        result = preflight(self.mesh, self.env.device, local_world_size=self.topo.ranks_per_node)
        for line in result.lines():
            self.log(line)
        if p == "strict" and not result.ok:
            raise PreflightError(result.message() + "; replace the node or set parallel.preflight=true to only warn")

    def lock_run_folders(self) -> list[RunLock]:
        """Rank 0 locks train.output_dir (and checkpoint.dir when it lies elsewhere) before anything is
        written there; every rank gets rank 0's verdict, so all stop together with its line."""
        folders = [(self.output_dir, "train.output_dir")]
        ck = self.checkpoint_dir.resolve()
        if not ck.is_relative_to(self.output_dir.resolve()):
            folders.append((self.checkpoint_dir, "checkpoint.dir"))

        def lock_all() -> list[RunLock]:
            locks: list[RunLock] = []
            try:
                for folder, what in folders:
                    try:
                        folder.mkdir(parents=True, exist_ok=True)
                    except OSError as e:
                        raise ConfigError(f"{what} {str(folder)!r} cannot be created: {e.strerror}") from None
                    # the lock over the checkpoints may clear a dead run's partial save (which may be what
                    # filled the disk) to make room for itself
                    holds_ck = folder == folders[-1][0]
                    room = (lambda: remove_partials(self.checkpoint_dir, self.log)) if holds_ck else None
                    lock = RunLock(folder, self.log, what, make_room=room)
                    lock.acquire()
                    locks.append(lock)
            except ShardlmError:
                for lock in locks:
                    lock.release()
                raise
            return locks

        return self.on_rank0(lock_all) or []  # the other ranks hold no lock

    def release_locks(self) -> None:
        for lock in self.locks:
            lock.release()
        self.locks = []

    def check_writable(self) -> None:
        """Every rank can write where it will write, and one checkpoint fits, before step 1."""
        env, c = self.env, self.cfg.checkpoint
        saved = self.params if self.cfg.lora.adapters_only else list(self.model.parameters())
        n_saved, n_trained = sum(p.numel() for p in saved), sum(p.numel() for p in self.params)
        need = 4 * n_saved + 8 * n_trained  # fp32 weights + two AdamW moments
        warnings, error = [], None
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if env.rank == 0:  # what a dead run's save left (it may be what filled the disk): before the probe
            remove_partials(self.checkpoint_dir, self.log)
        try:
            check_writable(self.output_dir, "train.output_dir", env.rank)
            if c.save_final or c.interval > 0:
                w = check_writable(self.checkpoint_dir, "checkpoint.dir" if c.dir else "train.output_dir",
                                   env.rank, need, share=local_world / env.world_size)
                warnings += [w] if w else []
        except (ConfigError, StorageError) as e:
            error = e
        flag = torch.tensor([float(error is not None)])
        dist.all_reduce(flag)
        if error is not None:
            raise error
        if flag.item():
            raise ConfigError("another rank cannot write its output or checkpoint folder (see its error)")
        for w in warnings:
            self.log(w)

    def run_info(self) -> dict:
        """Facts each checkpoint.json records (checkpoint/lineage.py)."""
        return {"world_size": self.env.world_size, "global_batch": self.loader.global_batch,
                "tokenizer": tokenizer_fingerprint(self.tokenizer_spec),
                "data": [{"source": src, **store.identity()} for (src, *_), store in zip(source_list(self.cfg),
                                                                                      self.stores)]}

    def lr_anchor(self):
        """Where the LR decay restarts after a resume that changed train.steps (see optim.lr_factor)."""
        rec, t = self.checkpointer.resumed_record, self.cfg.train
        if rec is None:
            return None
        info = rec.info
        if info.get("global_batch") not in (None, self.loader.global_batch):
            self.log(f"resume: the global batch changes from {info['global_batch']} to {self.loader.global_batch} "
                     f"sequences ({info.get('world_size')} -> {self.env.world_size} ranks x "
                     f"train.micro_batch_size={t.micro_batch_size} x grad_accum={t.grad_accum}); the data goes on "
                     "where it stopped, the LR schedule counts optimizer steps as before")
        sched = info.get("schedule") or {}
        saved_steps, saved = sched.get("steps"), sched.get("anchor")
        saved = tuple(saved) if isinstance(saved, list) and len(saved) == 2 else None
        if not isinstance(saved_steps, int):
            return None
        anchor = extended_anchor(self.step, t, saved_steps, saved)
        if saved_steps != t.steps:
            from shardlm.train.optim import lr_factor

            self.log(f"resume: train.steps {saved_steps} -> {t.steps}: the learning rate goes on from "
                     f"{t.lr * lr_factor(self.step, t, anchor):.3g} at step {self.step} and decays to "
                     f"{t.lr * t.min_lr_ratio:.3g} at step {t.steps} (no jump back up)")
        return anchor

    @property
    def checkpoint_dir(self) -> Path:
        return checkpoint_dir(self.cfg)

    def interrupted_line(self) -> str:
        """`interrupted at step N; last complete checkpoint step-M`: where a Ctrl-C leaves the run."""
        return f"interrupted at step {self.step}; {last_checkpoint(self.checkpoint_dir)}"

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
        loader, meta = build_loader(self.cfg, self.tokenizer, dp_rank(self.mesh), self.dims.dp, log=self.log,
                                    stores=self.stores)
        # every micro-batch's ids against the model's vocabulary: damaged store bytes stop with one line
        loader.vocab_size = self.model_cfg.vocab_size
        loader.source = ", ".join(str(s.path) for s in self.stores)
        return loader, meta

    def train_step(self, batches: list[Batch], stop_requested: bool = False) -> StepResult:
        """One optimizer step over `grad_accum` micro-batches (see `forward_backward` for the loss).

        Before the optimizer runs, the guard: the local loss sum rides on the grad-norm all-reduce,
        so a NaN/inf loss or gradient on any rank makes the norm non-finite on every rank, and all
        of them skip (or stop) together. A rank's stop request (SIGTERM, Ctrl-C) rides on the
        token-count all-reduce, so all ranks stop after the same step.
        """
        t, wd = self.cfg.train, self.watchdog
        # Counted on the host and reduced over gloo (the process group has a CPU backend on GPUs
        # too): no device sync, and the scale is a plain float. On log steps each rank also adds its
        # mean busy time per step in its own slot (a sum of one-hot vectors = a gather, no extra collective).
        ctrl_c = stop_requested and self.preemption.interrupted
        slots = self.busy.slots(self.env.rank, self.env.world_size) if self.logs_next_step() else []
        targets = sum(int((b[1] != IGNORE_INDEX).sum()) for b in batches)  # a batch: (x, y) or (x, y, positions)
        counts = torch.tensor([float(targets), float(stop_requested), float(ctrl_c), *slots])
        wd.enter("token-count all-reduce")
        self.busy.arrive()
        dist.all_reduce(counts)
        self.busy.leave()
        self.timer.lap("data")  # includes the wait for the slowest rank's batch (the count all-reduce)
        n_tokens, stop, ctrl_c = counts[:3].tolist()
        self.rank_step_times = counts[3:].tolist() if slots else None
        loss_sum = forward_backward(self.model, batches, self.dims.dp / n_tokens, self.env.device, t.grad_sync,
                                    self.dims.hsdp, loss_chunk_tokens=t.loss_chunk_tokens,
                                    sdpa_backends=self.sdpa_backends)
        wd.enter("grad-norm all-reduce")
        norm = clip_grad_norm_(self.params, t.grad_clip, flag=loss_sum)
        grad_norm = norm.item()  # the step's one host read: the guard decides before the optimizer does
        self.timer.lap("compute")
        bad = None if math.isfinite(grad_norm) else nonfinite_report(loss_sum, self.params)
        if bad is None:
            wd.enter("optimizer")
            self.optimizer.step()
            if self.fp8_all_gather:
                precompute_fp8_scales(self.model)
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.timer.lap("optimizer", sync=True)
        return StepResult(loss_sum / n_tokens, grad_norm, stop > 0, ctrl_c > 0, bad)

    def logs_next_step(self) -> bool:
        """Whether the step being run will be logged (the same answer on every rank)."""
        n = self.step + 1
        return n % self.cfg.metrics.log_every == 0 or n == self.cfg.train.steps

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
        """Run to train.steps optimizer steps (or until SIGTERM or Ctrl-C); returns the records logged by this
        process. A Ctrl-C ends with `Interrupted` once the checkpoint is saved."""
        t = self.cfg.train
        tokens_per_step = self.loader.global_batch * self.cfg.data.seq_len
        meter = Throughput(self.model_cfg.flops_per_token(self.cfg.data.seq_len), peak_flops(self.env.device),
                           self.env.world_size)
        self.announce(tokens_per_step)
        if self.env.device.type == "cuda" and meter.peak is None:
            self.log(f"mfu: not reported: no peak bf16 FLOP/s known for {torch.cuda.get_device_name(self.env.device)}")
        if self.step >= t.steps:
            self.log(f"nothing to do: the checkpoint is at step {self.step} and train.steps={t.steps}; "
                     "raise train.steps to train further")
        records, start, stopped, interrupted = [], time.perf_counter(), False, False
        self.checkpointer.info["schedule"] = {"steps": t.steps, "anchor": self.scheduler.anchor}
        self.preemption.catch_ctrl_c()  # from here to the end of the loop, Ctrl-C saves and stops
        with self.watchdog.guard():
            stopped, interrupted = self.loop(records, meter, tokens_per_step, start)
        self.preemption.release_ctrl_c()
        if stopped and not interrupted:
            self.log(f"preempted (SIGTERM): checkpoint at step {self.step} saved; exiting cleanly")
        self.finish(records, time.perf_counter() - start, sample=not stopped)
        if stopped and interrupted:
            if dist.is_initialized():
                dist.barrier()  # rank 0 has published the checkpoint: every rank's line names it
            raise Interrupted(self.interrupted_line())
        return records

    def loop(self, records: list[dict], meter: Throughput, tokens_per_step: int, start: float) -> tuple[bool, bool]:
        """Steps until train.steps or a stop request; (stopped, by Ctrl-C). Every collective in here runs
        under the watchdog: the phase of each is known, a failing one is one line."""
        t, wd, log_every = self.cfg.train, self.watchdog, self.cfg.metrics.log_every
        stopped = interrupted = False
        first = True
        while self.step < t.steps and not stopped:
            lr = self.scheduler.get_last_lr()[0]
            wd.step = self.step
            if self.profiler is not None:
                self.profiler.step_begin(self.step + 1)
            self.timer.mark()
            wd.enter("data")
            batches = self.loader.next_step()
            res = self.train_step(batches, self.preemption.requested)
            if self.profiler is not None:
                wd.enter("profile export")
                self.profiler.step_end(self.step + 1)
            self.timer.step()
            stopped, interrupted = res.stop, res.interrupted
            if first:  # compile, data and checkpoint load are behind us: the step timeout from here on
                first = False
                wd.enter("timeout change")
                set_timeouts(self.mesh, wd.pg_timeout_s(self.cfg.parallel.step_timeout_s))
                wd.set_timeout(self.cfg.parallel.step_timeout_s)
            meter.add(tokens_per_step)
            self.checkpointer.poll()
            if res.nonfinite is not None:
                self.on_nonfinite(res.nonfinite)
                if stopped:  # a stop request during a skipped step: checkpoint what there is
                    self.save(blocking=True)
                continue
            self.skipped_in_row = 0
            self.step += 1
            if self.step - self.started_at == 2:  # the optimizer state exists: this step's peak is the steady one
                wd.enter("reshard_after_forward=auto")
                if line := settle_auto_reshard(self.model, self.mesh, t.cpu_offload):
                    self.log(line)
            log_now = self.step % log_every == 0 or self.step == t.steps
            save_now = self.checkpointer.due(self.step, final=self.step == t.steps, stopped=stopped)
            loss_v = None
            if log_now or save_now:
                wd.enter("loss all-reduce")
                dist.all_reduce(res.loss)  # each rank holds its share of the global mean
                loss_v = res.loss.item()
            val = self.evaluate() if self.eval_due(stopped) else None
            if log_now:
                tps, mfu = meter.measure()
                rec = {"step": self.step, "loss": loss_v, "lr": lr, "grad_norm": res.grad_norm,
                       "tokens_per_sec": tps, "mfu": mfu, **read_and_reset_peak_memory(self.env.device),
                       "elapsed_s": time.perf_counter() - start, **self.step_times_record(), **self.timer.record(),
                       **(val or {})}
                records.append(rec)
                self.metrics.log(rec)
                if self.wandb is not None:
                    self.wandb.log(rec, self.step)
                self.log_mixture(final=self.step == t.steps)
            elif val is not None:  # an evaluation on a step that is not logged: a record of its own
                rec = {"step": self.step, **val, "elapsed_s": time.perf_counter() - start}
                self.metrics.log(rec)
                if self.wandb is not None:
                    self.wandb.log(rec, self.step)
            self.metrics.advance(loss_v, val["val_loss"] if val else None)
            if save_now:
                self.timer.mark()
                wd.enter("checkpoint save")
                self.save(final=self.step == t.steps, blocking=stopped)
                self.timer.lap("checkpoint")
        wd.enter("checkpoint save")
        self.checkpointer.wait()
        return stopped, interrupted

    def eval_due(self, stopped: bool) -> bool:
        """eval.interval steps, and the last step with eval.at_end (not when stopping early: a SIGTERM's grace is
        for the checkpoint). The same answer on every rank."""
        e = self.cfg.eval
        if self.validator is None:
            return False
        return bool(e.interval and self.step % e.interval == 0) or (e.at_end and self.step == self.cfg.train.steps
                                                                   and not stopped)

    def evaluate(self) -> dict:
        """The validation metrics at this step (a collective over every rank); remembers the best val_loss."""
        self.watchdog.enter("eval")
        val = self.validator.evaluate(self.model)  # type: ignore[union-attr]
        if self.best_val is None or val["val_loss"] < self.best_val[0]:
            self.best_val = (val["val_loss"], self.step)
        return val

    def step_times_record(self) -> dict:
        """step_time_max_rank / step_time_spread of this log interval (None before any step was timed), and
        a persistent straggler named in the log."""
        times = self.rank_step_times
        if not times or not any(times):
            return {"step_time_max_rank": None, "step_time_spread": None}
        out = self.step_times.record(times)
        if line := self.step_times.straggler_line():
            self.log(line)
        return out

    def announce(self, tokens_per_step: int) -> None:
        d, mc, m = self.cfg.data, self.model_cfg, self.data_meta
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.mesh.mesh_dim_names, self.mesh.shape))
        mesh += f" ({self.dims_reason})" if self.dims_reason else ""
        self.metrics.write(
            f"shardlm: {self.env.world_size} rank(s) on {self.env.device.type} ({self.env.backend}), mesh {mesh} | "
            f"model {self.cfg.model.init_from or self.cfg.model.preset}: {mc.num_params() / 1e6:.2f}M params"
            f"{self.trainable_note()}, {self.precision_note()} | "
            f"data {self.data_note()}, {m['tokens'] / 1e6:.2f}M tokens, {self.loader.n_rows} sequences of "
            f"{d.seq_len} | global batch {self.loader.global_batch} seqs = {tokens_per_step} tokens/step | "
            f"{self.fastpath_note()}")

    def check_mixture(self) -> None:
        """A mixture whose epoch caps cannot feed train.steps fails now, not mid-run; its plan is logged."""
        order = self.loader.order
        if not isinstance(self.loader, MixtureLoader):
            return
        cap, need = order.max_samples(), self.cfg.train.steps * self.loader.global_batch
        if cap is not None and need > cap:
            raise DataError(f"data.sources: the epochs caps allow {cap:,} samples, train.steps="
                            f"{self.cfg.train.steps} needs {need:,}; raise the caps or lower train.steps")
        self.log(order.describe())

    def log_mixture(self, final: bool) -> None:
        """A mixture's realised shares: when a source runs out (epochs cap) and at the last step."""
        if not isinstance(self.loader, MixtureLoader):
            return
        gone = self.loader.order.exhausted()
        if final or gone != getattr(self, "_exhausted", []):
            self._exhausted = gone
            self.log(self.loader.order.describe())

    def data_note(self) -> str:
        """`3 files`, `store NAME`, `mixture of 2 sources`; `, document masks (sdpa-mask: ...)` when on."""
        if len(self.stores) > 1:
            note = f"mixture of {len(self.stores)} sources"
        elif is_store(self.cfg.data.path):
            note = f"store {self.stores[0].path}"
        else:
            n = len(self.stores[0].manifest["sources"])
            note = f"{n} file{'s' if n != 1 else ''} (prepared: {self.stores[0].path})"
        return note + (f", document masks ({self.attention_note})" if self.cfg.data.document_mask else "")

    def precision_note(self) -> str:
        """``bf16``, or ``fp8 tensorwise (28 float8 linears, float8 all-gather)`` and the like."""
        t = self.cfg.train
        if t.mixed_precision == "auto":
            return f"{t.precision(self.env.device.type)} (train.mixed_precision=auto on {self.env.device.type})"
        if t.mixed_precision != "fp8":
            return t.mixed_precision
        float8 = float8_linear_class()
        n = sum(isinstance(m, float8) for m in self.model.modules()) if float8 else 0
        extra = ", float8 all-gather, scales precomputed after each step" if self.fp8_all_gather else ""
        return f"fp8 {t.fp8_recipe}{' emulated' if t.fp8_emulate else ''} ({n} float8 linears{extra})"

    def fastpath_note(self) -> str:
        """The kernels and FSDP schedule chosen: SDPA order, unsharded blocks, prefetch, optimizer kernel."""
        attn = ">".join(self.sdpa_backends) if self.sdpa_backends else "torch's default"
        fsdp = getattr(self.model, "fsdp_choices", None)
        opt = self.optimizer
        fused = " fused" if getattr(opt, "defaults", {}).get("fused") else ""
        return (f"attention {attn} ({self.sdpa_note}), fsdp {fsdp.note() if fsdp else '?'}, "
                f"optimizer {type(opt).__name__}{fused}")

    def trainable_note(self) -> str:
        """`` (3.1% trainable: LoRA r=8)`` when not every parameter trains."""
        total = sum(p.numel() for p in self.model.parameters())
        trainable = sum(p.numel() for p in self.params)
        if trainable == total:
            return ""
        lora = (f": LoRA r={self.cfg.lora.rank}, base {base_dtype(self.cfg, self.env.device.type)}"
                if self.cfg.lora.rank else "")
        return f" ({trainable / 1e6:.3f}M = {100 * trainable / total:.1f}% trainable{lora})"

    def finish(self, records: list[dict], elapsed: float, sample: bool = True) -> None:
        t = self.cfg.train
        if records:
            skipped = f" ({self.skipped_total} non-finite steps skipped)" if self.skipped_total else ""
            ran = self.step - self.started_at
            span = f"steps {self.started_at + 1}-{self.step}" if ran > 1 else f"step {self.step}"
            best = f", best val_loss {self.best_val[0]:.4f} at step {self.best_val[1]}" if self.best_val else ""
            self.metrics.write(f"done: ran {ran} step{'s' if ran != 1 else ''} ({span}; {self.step} of "
                               f"train.steps={t.steps}) in {elapsed:.1f}s{skipped}, loss {records[0]['loss']:.3f} -> "
                               f"{records[-1]['loss']:.3f}{best}; outputs in {self.output_dir}/ (config.toml, "
                               "metrics.jsonl)")
        if sample and t.sample_tokens > 0:
            self.watchdog.enter("sample")
            prompt = prompt_ids(self.tokenizer, t.sample_prompt)
            warning = check_context([prompt], t.sample_tokens, self.cfg.data.seq_len, "train.sample_tokens")
            if warning:  # the sample stops at the context
                self.metrics.write(f"sample: warning: {warning}")
            ids = generate(self.model, prompt, t.sample_tokens, self.cfg.data.seq_len, seed=t.seed,
                           device=self.env.device)
            self.metrics.write("sample:\n" + self.tokenizer.decode(ids))
        if self.profiler is not None:
            self.profiler.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.metrics.close()

    def close(self) -> None:
        """Finish the in-flight save, release the model and every process group; the end of a Trainer."""
        self.watchdog.enter("shutdown")
        self.preemption.uninstall()
        if getattr(self, "profiler", None) is not None:
            self.profiler.close()
        if getattr(self, "wandb", None) is not None:
            self.wandb.finish(exit_code=1)  # a no-op after a clean finish; marks a crashed run failed
        self.checkpointer.close()
        self.release_locks()
        # The FSDP state inside the model holds the process groups: drop it so that their threads end
        # here and not during interpreter shutdown (see shutdown_distributed).
        self.model = self.optimizer = self.scheduler = self.params = None
        shutdown_distributed()
        self.watchdog.stop()  # after the teardown: one that hangs is still ended by the backstop


def checkpoint_dir(cfg: Config) -> Path:
    """checkpoint.dir, or <train.output_dir>/checkpoints."""
    c = cfg.checkpoint
    return Path(c.dir) if c.dir else Path(cfg.train.output_dir) / "checkpoints"


def last_checkpoint(folder: Path) -> str:
    """`last complete checkpoint step-M` (the one resume=auto takes), or `no checkpoint saved`."""
    done = current_lineage(folder)
    return f"last complete checkpoint {done[0].name}" if done else "no checkpoint saved"


def stands(folder: Path) -> str:
    """What a failed run leaves to resume from: `the last complete checkpoint step-M stands (...)`, or that
    none was saved."""
    done = current_lineage(folder)
    if done:
        return f"the last complete checkpoint {done[0].name} stands (resume with checkpoint.resume=auto)"
    return "no checkpoint was saved yet: a restart begins at step 0"


def train(cfg: Config) -> list[dict]:
    """Build a Trainer from `cfg`, run it to the end and release everything, also after an error."""
    trainer = None
    try:
        trainer = Trainer(cfg)
        return trainer.train()
    except KeyboardInterrupt:  # Ctrl-C outside the loop (setup, the final sample): nothing to finish
        where = f"at step {trainer.step}" if trainer is not None else "during setup"
        raise Interrupted(f"interrupted {where}; {last_checkpoint(checkpoint_dir(cfg))}") from None
    finally:
        if trainer is not None:
            trainer.close()
        else:  # the Trainer failed part-way: still free the process group it may have joined
            shutdown_distributed()
