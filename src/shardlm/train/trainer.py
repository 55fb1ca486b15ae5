"""Trainer: the build calls (mesh, data, model, optimizer, checkpointer), the loop and the step.

The run's operations (environment, launch, process group, watchdog, preemption, locks) are the Session's
(train/session.py), taken once around the run and released in reverse; what the run says is the Report's
(observe/report.py); what the config implies is resolved once (resolve.py).
"""

from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardlm.build import STORED_FORMS, build_model, build_model_config, model_state_bytes
from shardlm.checkpoint import Checkpointer
from shardlm.checkpoint.lineage import RunFacts, Schedule
from shardlm.checkpoint.meta import CheckpointMeta
from shardlm.config import Config
from shardlm.data import MixtureLoader, build_loader, load_tokenizer, open_stores, parse_sources
from shardlm.data.loader import IGNORE_INDEX, mixture_val_stores, open_val_store
from shardlm.data.store import is_store
from shardlm.distributed.preflight import BusyTime, StepTimes
from shardlm.distributed.watchdog import set_timeouts
from shardlm.errors import Interrupted
from shardlm.eval.validation import best_logged, build_validator, needs_validation
from shardlm.generate import sample
from shardlm.models.llama import document_attention_backend
from shardlm.observe.metrics import MetricsLogger, Throughput, peak_flops, read_and_reset_peak_memory
from shardlm.observe.profiler import PhaseTimer, StepProfiler
from shardlm.observe.report import Report, data_note, experts_note, fastpath_note, mesh_note, precision_note, trainable_note
from shardlm.observe.wandb_log import run_wandb
from shardlm.parallel.dims import cp_slot, dp_rank
from shardlm.parallel.fsdp import DTYPES, clip_grad_norm_, settle_auto_reshard
from shardlm.quant.fp8 import precompute_fp8_scales
from shardlm.resolve import checkpoint_dir, resolve
from shardlm.train.optim import build_lr_scheduler, build_optimizer, resume_anchor
from shardlm.train.rundir import write_run_files
from shardlm.train.sdpa import sdpa_backends_for
from shardlm.train.session import Session, last_checkpoint
from shardlm.train.state import TrainState
from shardlm.train.step import Batch, NonfiniteSteps, StepResult, forward_backward, nonfinite_report, router_losses


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.output_dir = Path(cfg.train.output_dir)
        self.report = Report(rank0=os.environ.get("RANK", "0") == "0")
        self.session = Session(cfg, self.log, self.interrupted_line)
        try:
            self.start()
        except BaseException:
            self.session.close()  # a start that failed leaves the folder free and no process group behind
            raise

    def start(self) -> None:
        """Everything that can be wrong with the config fails before any collective; the data is prepared
        before the process group starts (no collective waits on it, so no timeout can fire)."""
        cfg, s = self.cfg, self.session
        self.run = resolve(cfg)  # the data, the checkpoints and the logs take its tokenizer
        self.tokenizer = load_tokenizer(self.run.tokenizer)
        warnings: list[str] = []
        self.model_cfg = build_model_config(cfg, self.tokenizer.vocab_size, warn=warnings.append)
        s.launch(self.run, functools.partial(model_state_bytes, cfg, self.model_cfg))
        self.topo, self.dims, self.dims_reason = s.topo, s.dims, s.dims_reason
        self.open_data()
        self.env = s.join()
        self.is_rank0 = self.env.rank == 0
        self.watchdog, self.preemption = s.watchdog, s.preemption
        s.startup_lines(warnings)
        torch.manual_seed(cfg.train.seed)
        with self.watchdog.guard("setup: mesh"):
            self.mesh = s.mesh()
            self.build()

    def open_data(self) -> None:
        """The token stores (raw files are prepared into one now, once per shared filesystem) and the
        validation data, which eval.interval needs."""
        cfg, first = self.cfg, self.report.rank0
        say = lambda line: print(line, flush=True)  # noqa: E731
        quiet = say if first else (lambda line: None)
        spec = self.run.tokenizer
        self.stores = open_stores(cfg.data, self.tokenizer, log=say, wait_log=quiet, tokenizer_spec=spec)
        self.val_store = open_val_store(cfg.data, cfg.eval, self.tokenizer, say, quiet, tokenizer_spec=spec)
        self.val_sources = mixture_val_stores(cfg.data, cfg.eval, log=quiet)
        needs_validation(cfg.data, cfg.eval, self.val_store, self.val_sources)
        if first:
            self.report.validation_sets(cfg.eval, [self.val_store] if self.val_store else [v for _, v in self.val_sources])

    def build(self) -> None:
        """Data, model, optimizer, checkpointer and resume, schedule, run files: after the folder lock."""
        cfg, wd, s = self.cfg, self.watchdog, self.session
        wd.enter("setup: data")
        self.loader, self.data_meta = self.build_data()
        self.check_mixture()
        backend, why = document_attention_backend(self.env.device)
        self.attention_note = f"{backend}: {why}"
        self.sdpa_backends, self.sdpa_note = sdpa_backends_for(  # an unusable explicit kernel stops here
            cfg.train.attention_backend, self.env.device, DTYPES[self.run.compute_dtype],
            self.model_cfg.head_dim, dense_mask=cfg.data.document_mask and backend == "sdpa-mask")
        wd.enter("setup: model")
        self.model = build_model(cfg, self.model_cfg, self.mesh, self.env.device)
        s.on_close(self.release_model)
        wd.attach(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.router = router_losses(self.model, self.model_cfg, self.dims.grad_ranks)  # None unless experts
        if self.router is not None and hasattr(self.loader, "mark_padding"):  # SFT padding: out of the router stats
            self.loader.mark_padding = True
        saved = self.params if cfg.lora.adapters_only else list(self.model.parameters())
        s.check_writable(sum(p.numel() for p in saved), sum(p.numel() for p in self.params))
        self.fp8_all_gather = self.run.fp8_all_gather
        self.nonfinite = NonfiniteSteps(cfg.train, self.log)
        self.stepped = False  # the first step was run (then the step timeout applies)
        self.busy, self.rank_step_times = BusyTime(), None
        self.step_times = StepTimes(self.env.world_size, self.topo.ranks_per_node, min_excess_s=0.01)
        self.optimizer = build_optimizer(self.model, cfg.train, self.env.device)
        self.state = TrainState(self.loader, self.env.device)
        self.resume()
        self.on_rank0(lambda: write_run_files(self.output_dir, cfg.to_toml(), self.step if self.resumed_from else None,
                                              self.log))
        self.open_outputs()

    def resume(self) -> None:
        """The checkpointer, the checkpoint load (checkpoint.resume) and the LR schedule from there."""
        cfg, wd = self.cfg, self.watchdog
        self.checkpointer = Checkpointer(cfg.checkpoint, self.checkpoint_dir, self.env.rank, self.model,
                                         self.optimizer, {"trainer": self.state}, log=self.log,
                                         trainable_only=cfg.lora.adapters_only, forms=STORED_FORMS,
                                         meta=CheckpointMeta.from_config(cfg, self.model_cfg, self.run.tokenizer),
                                         facts=self.run_facts())
        self.session.on_close(self.checkpointer.close)
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
        rec = self.checkpointer.resumed_record  # where the LR decay restarts after train.steps changed
        anchor = None if rec is None else resume_anchor(rec.facts, self.step, cfg.train, self.loader.global_batch,
                                                         self.env.world_size, self.log)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.train, last_step=self.step, anchor=anchor)
        self.checkpointer.facts.schedule = Schedule(cfg.train.steps, self.scheduler.anchor)

    def open_outputs(self) -> None:
        """Metrics, validation, profiler, phase timer and W&B."""
        cfg, m, pr, t = self.cfg, self.cfg.metrics, self.cfg.profile, self.cfg.train
        metrics = MetricsLogger(self.output_dir, t.steps, self.is_rank0, m.progress_bar, m.tensorboard,
                                start_step=self.step)
        self.watchdog.enter("setup: eval")
        self.validator = build_validator(cfg.data, cfg.eval, self.val_store, self.val_sources, self.tokenizer,
                                         dp_rank(self.mesh), self.dims.dp, self.env.device,
                                         micro_batch_size=t.micro_batch_size, loss_chunk_tokens=t.loss_chunk_tokens,
                                         cp=cp_slot(self.mesh))
        # the best val_loss of the run so far (a resume carries the one logged before it)
        self.best_val = best_logged(self.output_dir / "metrics.jsonl", self.step) \
            if self.resumed_from is not None and self.is_rank0 else None
        self.profiler = StepProfiler(self.output_dir, pr.start_step, pr.steps, self.env.rank, self.env.device,
                                     log=self.log, memory=pr.memory) if pr.enabled else None
        if self.profiler is not None:
            self.session.on_close(self.profiler.close)
        sync = torch.cuda.synchronize if self.env.device.type == "cuda" and m.phase_sync else None
        self.timer = PhaseTimer(sync=sync)
        wandb = run_wandb(self.output_dir, cfg, self.resumed_from is not None, self.is_rank0, self.on_rank0,
                          self.log)
        self.report.open(metrics, wandb)
        self.session.on_close(self.report.abort)

    def on_rank0(self, fn):  # Session.on_rank0: rank 0's shardlm error stops every rank alike
        return self.session.on_rank0(fn)

    def release_locks(self) -> None:
        self.session.release_locks()

    def release_model(self) -> None:
        """The FSDP state inside the model holds the process groups: drop it before they are destroyed, so
        that their threads end then and not during interpreter shutdown (see shutdown_distributed)."""
        self.model = self.optimizer = self.scheduler = self.params = None

    def run_facts(self) -> RunFacts:
        """Facts each checkpoint.json records (checkpoint/lineage.py); the schedule is added once known."""
        data = [{"source": src.path, **store.identity()} for src, store in zip(parse_sources(self.cfg.data), self.stores)]
        return RunFacts(world_size=self.env.world_size, global_batch=self.loader.global_batch,
                        tokenizer=self.tokenizer.ref.checkpoint_record(), data=data)

    @property
    def checkpoint_dir(self) -> Path:
        return checkpoint_dir(self.cfg)

    def interrupted_line(self) -> str:
        """`interrupted at step N; last complete checkpoint step-M`: where a Ctrl-C leaves the run."""
        return f"interrupted at step {self.step}; {last_checkpoint(self.checkpoint_dir)}"

    def log(self, line: str) -> None:
        """A line on rank 0 (through the progress bar once there is one)."""
        self.report.line(line)

    @property
    def skipped_total(self) -> int:
        return self.nonfinite.total

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
        t = self.cfg.train
        return build_loader(self.cfg.data, self.tokenizer, dp_rank(self.mesh), self.dims.dp,
                            micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum, seed=t.seed, log=self.log,
                            stores=self.stores, vocab_size=self.model_cfg.vocab_size, cp=cp_slot(self.mesh))

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
        # a batch: (x, y[, positions[, real]]) (step.Batch); under parallel.cp each rank's labels are its slice of rows
        targets = sum(int((b[1] != IGNORE_INDEX).sum()) for b in batches)
        counts = torch.tensor([float(targets), float(stop_requested), float(ctrl_c), *slots])
        wd.enter("token-count all-reduce")
        self.busy.arrive()
        dist.all_reduce(counts)
        self.busy.leave()
        self.timer.lap("data")  # includes the wait for the slowest rank's batch (the count all-reduce)
        n_tokens, stop, ctrl_c = counts[:3].tolist()
        self.rank_step_times = counts[3:].tolist() if slots else None
        loss_sum = forward_backward(self.model, batches, self.dims.grad_ranks / n_tokens, self.env.device, t.grad_sync,
                                    self.dims.hsdp, loss_chunk_tokens=t.loss_chunk_tokens,
                                    sdpa_backends=self.sdpa_backends, router=self.router)
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
        moe = self.router.read() if self.router is not None and self.logs_next_step() else None
        return StepResult(loss_sum / n_tokens, grad_norm, stop > 0, ctrl_c > 0, bad, moe)

    def logs_next_step(self) -> bool:
        """Whether the step being run will be logged (the same answer on every rank)."""
        n = self.step + 1
        return n % self.cfg.metrics.log_every == 0 or n == self.cfg.train.steps

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
        records, start = [], time.perf_counter()
        self.preemption.catch_ctrl_c()  # from here to the end of the loop, Ctrl-C saves and stops
        with self.watchdog.guard():
            stopped, interrupted = self.loop(records, meter, tokens_per_step, start)
        self.preemption.release_ctrl_c()
        if stopped and not interrupted:
            self.log(f"preempted (SIGTERM): checkpoint at step {self.step} saved; exiting cleanly")
        self.finish(records, time.perf_counter() - start, with_sample=not stopped)
        if stopped and interrupted:
            if dist.is_initialized():
                dist.barrier()  # rank 0 has published the checkpoint: every rank's line names it
            raise Interrupted(self.interrupted_line())
        return records

    def loop(self, records: list[dict], meter: Throughput, tokens_per_step: int, start: float) -> tuple[bool, bool]:
        """Steps until train.steps or a stop request; (stopped, by Ctrl-C). Every collective in here runs
        under the watchdog: the phase of each is known, a failing one is one line."""
        t, wd = self.cfg.train, self.watchdog
        stopped = interrupted = False
        while self.step < t.steps and not stopped:
            lr = self.scheduler.get_last_lr()[0]
            res = self.timed_step()
            stopped, interrupted = res.stop, res.interrupted
            meter.add(tokens_per_step)
            self.checkpointer.poll()
            if res.nonfinite is not None:
                self.nonfinite.bad(self.step + 1, res.nonfinite)
                if stopped:  # a stop request during a skipped step: checkpoint what there is
                    self.save(blocking=True)
                continue
            self.nonfinite.good()
            self.step += 1
            self.after_warmup()
            final = self.step == t.steps
            log_now = self.step % self.cfg.metrics.log_every == 0 or final
            save_now = self.checkpointer.due(self.step, final=final, stopped=stopped)
            evaluate = self.validator is not None and self.validator.due(self.step, final=final, stopped=stopped)
            loss = self.global_loss(res) if log_now or save_now else None
            val = self.evaluate() if evaluate else None
            self.record(log_now, res, lr, loss, val, meter, start, records)
            if save_now:
                self.timer.mark()
                wd.enter("checkpoint save")
                self.save(final=final, blocking=stopped)
                self.timer.lap("checkpoint")
        wd.enter("checkpoint save")
        self.checkpointer.wait()
        return stopped, interrupted

    def timed_step(self) -> StepResult:
        """One optimizer step with its data, phase timing and profiling; after the first, the step timeout."""
        wd = self.watchdog
        wd.step = self.step
        if self.profiler is not None:
            self.profiler.step_begin(self.step + 1)
        self.timer.mark()
        wd.enter("data")
        res = self.train_step(self.loader.next_step(), self.preemption.requested)
        if self.profiler is not None:
            wd.enter("profile export")
            self.profiler.step_end(self.step + 1)
        self.timer.step()
        if not self.stepped:  # compile, data and checkpoint load are behind us: the step timeout from here on
            self.stepped = True
            wd.enter("timeout change")
            set_timeouts(self.mesh, wd.pg_timeout_s(self.cfg.parallel.step_timeout_s))
            wd.set_timeout(self.cfg.parallel.step_timeout_s)
        return res

    def after_warmup(self) -> None:
        """At the second step the optimizer state exists and the peak is the steady one:
        reshard_after_forward=auto settles."""
        if self.step - self.started_at == 2:
            self.watchdog.enter("reshard_after_forward=auto")
            if line := settle_auto_reshard(self.model, self.mesh, self.cfg.train.cpu_offload):
                self.log(line)

    def global_loss(self, res: StepResult) -> float:
        """The step's mean loss over every rank (each holds its share)."""
        self.watchdog.enter("loss all-reduce")
        dist.all_reduce(res.loss)
        return res.loss.item()

    def record(self, log_now: bool, res: StepResult, lr: float, loss: float | None, val: dict | None,
               meter: Throughput, start: float, records: list[dict]) -> None:
        """The step's metrics record on log steps (an evaluation on another step gets one of its own)."""
        if log_now:
            tps, mfu = meter.measure()
            rec = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": res.grad_norm,
                   "tokens_per_sec": tps, "mfu": mfu, **read_and_reset_peak_memory(self.env.device),
                   "elapsed_s": time.perf_counter() - start,
                   **self.report.stragglers(self.step_times, self.rank_step_times), **self.timer.record(),
                   **(res.moe or {}), **(val or {})}
            records.append(rec)
            self.report.step(rec, self.step)
            self.report.mixture(self.loader, final=self.step == self.cfg.train.steps)
        elif val is not None:
            self.report.step({"step": self.step, **val, "elapsed_s": time.perf_counter() - start}, self.step)
        self.report.metrics.advance(loss, val["val_loss"] if val else None)

    def evaluate(self) -> dict:
        """The validation metrics at this step (a collective over every rank); remembers the best val_loss."""
        self.watchdog.enter("eval")
        val = self.validator.evaluate(self.model)  # type: ignore[union-attr]
        if self.best_val is None or val["val_loss"] < self.best_val[0]:
            self.best_val = (val["val_loss"], self.step)
        return val

    def announce(self, tokens_per_step: int) -> None:
        """The startup line: ranks, mesh, model, precision, data, batch, kernels."""
        d, mc, m, dev = self.cfg.data, self.model_cfg, self.data_meta, self.env.device.type
        self.log(
            f"shardlm: {self.env.world_size} rank(s) on {dev} ({self.env.backend}), mesh "
            f"{mesh_note(self.mesh, self.dims_reason)} | model {self.cfg.model.init_from or self.cfg.model.preset}: "
            f"{mc.num_params() / 1e6:.2f}M params{experts_note(mc)}"
            f"{trainable_note(self.cfg, self.model, self.params, self.run.base_dtype)}, "
            f"{precision_note(self.cfg, dev, self.model, self.run.fp8_all_gather)} | data "
            f"{data_note(self.cfg, self.stores, is_store(self.cfg.data.path), self.attention_note)}, "
            f"{m['tokens'] / 1e6:.2f}M tokens, {self.loader.n_rows} sequences of {d.seq_len} | global batch "
            f"{self.loader.global_batch} seqs = {tokens_per_step} tokens/step | "
            f"{fastpath_note(self.sdpa_backends, self.sdpa_note, self.model, self.optimizer)}")
        if (cp := self.model.context_parallel) is not None:  # parallel.cp: which exchange, how the heads split
            self.log(f"{cp.describe(mc.n_heads, mc.n_kv_heads)}; {d.seq_len // cp.size} of {d.seq_len} tokens per rank")

    def check_mixture(self) -> None:
        """A mixture whose epoch caps cannot feed train.steps fails now, not mid-run; its plan is logged."""
        if isinstance(self.loader, MixtureLoader):
            self.loader.order.check_feeds(self.cfg.train.steps, self.loader.global_batch)
            self.log(self.loader.order.describe())

    def finish(self, records: list[dict], elapsed: float, with_sample: bool = True) -> None:
        """The final line, the end-of-training sample (train.sample_tokens), the outputs closed."""
        t = self.cfg.train
        self.report.final(records, self.started_at, self.step, t.steps, elapsed, self.nonfinite.total, self.best_val,
                          self.output_dir)
        if with_sample and t.sample_tokens > 0:
            self.watchdog.enter("sample")
            for line in sample(self.model, self.tokenizer, t, self.cfg.data.seq_len, self.env.device):
                self.log(line)
        if self.profiler is not None:
            self.profiler.close()
        self.report.finish()

    def close(self) -> None:
        """Finish the in-flight save, release the model and every process group: the end of a Trainer (the
        session gives back everything the run took, last taken first)."""
        self.session.close()


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
        if trainer is not None:  # (a Trainer that failed to start gave back what it took already)
            trainer.close()
