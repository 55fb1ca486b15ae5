"""What does a shardlm checkpoint cost: time, rank-0 memory, and how long the training loop is blocked?

    torchrun --standalone --nproc_per_node 2 benchmarks/checkpoint.py [--repeats R] [--steps N] [--save]

One run, 2 gloo ranks on CPU (one thread per rank), ONE `Trainer` (fp32, FSDP2 over both ranks) on a model
of a few hundred MB of state: the debug preset with model.dim=1024 n_layers=2 ffn_dim=2816 n_heads=8
n_kv_heads=4 vocab_size=8192 (35.7M parameters; params + 2 AdamW moments, fp32 = 408 MiB), seq_len 64,
micro batch 1, on ~1 MB of the stdlib's sources written to a temp dir. Two Checkpointers over the same
model: the Trainer's own (checkpoint.async=false) and one built from the same [checkpoint] section with
async=true (its own gloo group, as shardlm makes it); `trainer.checkpointer` is pointed at one or the other.

Measured, each repeated R times with the order alternating/rotating per repeat, medians reported:

 1. Save time of model + optimizer (+ trainer state), every rank's wall clock from a common barrier to the
    save's return, the slowest rank's reported:
      DCP   `Checkpointer.save(..., blocking=True)`: barrier, get_state_dict, dcp.save (each rank writes its
            own shard; DCP's FileSystemWriter fsyncs its files), rank 0's atomic rename + prune.
      full  `get_model_state_dict` + `get_optimizer_state_dict` with StateDictOptions(full_state_dict=True,
            cpu_offload=True) (all-gathers every tensor; rank 0 keeps a CPU copy of it all), then rank 0
            `torch.save`s {model, optim, trainer} to one file, flush + fsync (as DCP does), a closing barrier.
 2. RSS added on each rank by the save: a background thread (`PeakRSS`, benchmarks/_common.py) reads
    /proc/self/statm every 5 ms; the figure is the peak minus the RSS just before the save (after gc.collect()
    and malloc_trim(0), so memory freed by an earlier measurement doesn't hide in the baseline). Next to it the
    kernel's own peak (VmHWM, reset through /proc/self/clear_refs just before the save) minus the same baseline:
    the sampler can't miss that one.
    Compared with the rank's shard (its local params + AdamW state bytes) and the full model + optimizer.
    The async save's figure (staging copy + background write, until it's on disk) is shown as well.
 3. How long the training loop is blocked:
      `trainer.save()` return time, async off (= the whole blocking DCP save) vs async on (barrier,
      get_state_dict, DCP's staging copy of the state into fresh host memory, start of the writer thread);
      for async, also how much longer the write takes after that (`checkpointer.wait()` called at once).
      Wall time of `Trainer.train()` running N steps with a checkpoint at step N/2 (checkpoint.interval
      placed so), async off vs on, and with no save for reference. train() ends with checkpointer.wait(), so
      every variant's time includes its checkpoint being complete on disk; with async on, the write overlaps
      the remaining steps (on these 2 shared cores it competes with them for CPU).

Checkpoints go to a temp dir under /tmp, deleted after each measurement (outside the timed part) and at exit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import (
    ROOT,
    MiB,
    PeakRSS,
    clear,
    du,
    gather,
    local_and_full_bytes,
    report,
    say,
    settle,
    shared_tmpdir,
    slowest,
    state_tensors,
    write_corpus,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from shardlm.build import STORED_FORMS
from shardlm.checkpoint import Checkpointer
from shardlm.config import load_config
from shardlm.observe.metrics import MetricsLogger
from shardlm.train.trainer import Trainer

RESULT = Path(__file__).resolve().parent / "results" / "checkpoint_cpu.txt"
CORPUS_BYTES = 1 << 20
MODEL = ["--model.preset=debug", "--model.dim=1024", "--model.n_layers=2", "--model.ffn_dim=2816",
         "--model.n_heads=8", "--model.n_kv_heads=4", "--model.vocab_size=8192"]


def measure(*fns) -> tuple[list[float], list[list[float]]]:
    """Run fns one after the other from a common barrier, RSS sampled over all of them.
    -> (per fn: the slowest rank's wall seconds, per rank: [RSS added, VmHWM added] in bytes)."""
    settle()
    dist.barrier()
    walls = []
    with PeakRSS() as m:
        for fn in fns:
            t0 = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - t0)
    return slowest(walls), gather([m.added, m.hwm_added])


# -- benchmark -------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="repeats of every measurement (default 3)")
    ap.add_argument("--steps", type=int, default=4, help="training steps per timed train() call; the "
                    "checkpoint falls after step N/2 (default 4)")
    ap.add_argument("--save", action="store_true", help=f"also write the report to {RESULT.relative_to(ROOT)}")
    args = ap.parse_args()
    if args.repeats < 1 or args.steps < 2:
        ap.error("--repeats must be >= 1 and --steps >= 2")

    torch.set_num_threads(1)  # 2 ranks on 2 cores
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tmp = shared_tmpdir("shardlm-ckpt-bench-", "/tmp",
                        fill=lambda d: write_corpus(d / "corpus.jsonl", CORPUS_BYTES))
    log = open(tmp / f"trainer-rank{rank}.log", "w")
    bench = Bench(tmp, rank, log)
    sizes = warmup(bench)
    res: dict[str, list] = {k: [] for k in ("dcp", "full", "blk_sync", "blk_async", "loop_none", "loop_sync",
                                            "loop_async")}
    measure_saves(bench, args.repeats, res)
    measure_blocking(bench, args.repeats, res)
    measure_loop(bench, args.repeats, args.steps, res)
    if bench.rank0:
        fig = Figures(res, dist.get_world_size())
        report([*header_lines(bench, args, sizes), *table_lines(fig, args, sizes), *summary_lines(fig, args, sizes)],
               RESULT if args.save else None)
    bench.close()
    log.close()
    if bench.rank0:
        shutil.rmtree(tmp, ignore_errors=True)


class Bench:
    """ONE Trainer and its two Checkpointers (async off: the Trainer's own; async on), and what is measured."""

    def __init__(self, tmp: Path, rank: int, log) -> None:
        self.tmp, self.log, self.rank0 = tmp, log, rank == 0
        self.cfg = cfg = load_config(None, [
            *MODEL, "--train.mixed_precision=fp32", "--train.device=cpu", "--train.micro_batch_size=1",
            "--train.grad_accum=1", "--train.steps=100000", f"--train.output_dir={tmp / 'run'}",
            "--data.seq_len=64", f"--data.path={tmp / 'corpus.jsonl'}", f"--data.cache_dir={tmp / 'cache'}",
            "--metrics.progress_bar=false", "--metrics.log_every=100000",
            "--checkpoint.save_final=false", "--checkpoint.resume=none", "--checkpoint.interval=0",
            "--checkpoint.keep_last=0", "--checkpoint.async=false", f"--checkpoint.dir={tmp / 'ckpt-sync'}",
        ])
        with contextlib.redirect_stdout(log):
            self.trainer = trainer = Trainer(cfg)
            self.ck_sync = trainer.checkpointer
            self.ck_async = Checkpointer(dataclasses.replace(cfg.checkpoint, async_=True, dir=str(tmp / "ckpt-async")),
                                         tmp / "ckpt-async", rank, trainer.model, trainer.optimizer,
                                         {"trainer": trainer.state}, log=trainer.log, forms=STORED_FORMS)
        self.model, self.opt = trainer.model, trainer.optimizer
        self.step_id = 10**6  # step numbers for direct saves, never clashing with training steps
        self.full_file = tmp / "full.pt"
        self.full_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def train(self, n: int, save_at: int | None, ck: Checkpointer) -> None:
        """One Trainer.train() call of n more steps, a checkpoint after step trainer.step + save_at."""
        trainer, cfg = self.trainer, self.cfg
        s = trainer.step
        if save_at is not None and s == 0:
            raise RuntimeError("place the save by interval needs trainer.step > 0 (run a warmup first)")
        # interval = s + save_at: its only multiple in (s, s + n] is s + save_at (2 * interval > s + n).
        c = dataclasses.replace(cfg.checkpoint, interval=0 if save_at is None else s + save_at)
        trainer.cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=s + n), checkpoint=c)
        trainer.report.open(MetricsLogger(trainer.output_dir, s + n, self.rank0, False, False, start_step=s), None)
        trainer.checkpointer = ck
        with contextlib.redirect_stdout(self.log):
            trainer.train()

    def dcp_save(self) -> None:
        self.step_id += 1
        with contextlib.redirect_stdout(self.log):
            self.ck_sync.save(self.step_id, blocking=True)

    def full_save(self) -> None:
        msd = get_model_state_dict(self.model, options=self.full_opts)
        osd = get_optimizer_state_dict(self.model, self.opt, options=self.full_opts)
        if self.rank0:
            with open(self.full_file, "wb") as f:
                torch.save({"model": msd, "optim": osd, "trainer": self.trainer.state.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
        del msd, osd
        dist.barrier()

    def trainer_save(self, ck: Checkpointer) -> None:
        self.trainer.checkpointer = ck
        with contextlib.redirect_stdout(self.log):
            self.trainer.save()

    def wait_async(self) -> None:
        with contextlib.redirect_stdout(self.log):
            self.ck_async.wait()

    def close(self) -> None:
        with contextlib.redirect_stdout(self.log):
            self.ck_async.close()
            self.trainer.checkpointer = self.ck_sync
            self.trainer.close()  # closes ck_sync and the default group


@dataclasses.dataclass
class Sizes:
    """What the warmup learnt: the state's size, on each rank and on disk."""

    full_b: int  # params + AdamW state, all ranks
    shard_b: list  # each rank's share of it
    dcp_disk: int  # rank 0: the DCP checkpoint's files
    full_disk: int  # rank 0: the torch.save file


def warmup(b: Bench) -> Sizes:
    """Untimed: optimizer state exists, every code path ran once."""
    say("warmup ...")
    t0 = time.perf_counter()
    b.train(2, None, b.ck_sync)
    step_time = (time.perf_counter() - t0) / 2
    local_b, full_b = local_and_full_bytes(state_tensors(b.model, b.opt))
    shard_b = [int(x[0]) for x in gather([float(local_b)])]
    b.dcp_save()
    dcp_disk = du(b.tmp / "ckpt-sync") if b.rank0 else 0
    clear(b.tmp / "ckpt-sync")
    b.full_save()
    full_disk = du(b.full_file) if b.rank0 else 0
    clear(b.full_file)
    b.trainer_save(b.ck_async)
    b.wait_async()
    clear(b.tmp / "ckpt-async")
    say(f"warmup done ({step_time:.2f} s/step incl. first-step costs); shard {shard_b[0] / MiB:.0f} MiB, "
        f"full {full_b / MiB:.0f} MiB")
    return Sizes(full_b, shard_b, dcp_disk, full_disk)


def measure_saves(b: Bench, repeats: int, res: dict) -> None:
    """1 + 2: save time and RSS, DCP vs full state dict."""
    for r in range(repeats):
        for which in (("dcp", "full") if r % 2 == 0 else ("full", "dcp")):
            if which == "dcp":
                w, mem = measure(b.dcp_save)
                clear(b.tmp / "ckpt-sync")
            else:
                w, mem = measure(b.full_save)
                clear(b.full_file)
            res[which].append((w[0], mem))
            say(f"[{r + 1}/{repeats}] {which:>4} save {w[0]:6.2f} s, rank-0 RSS +{mem[0][0] / MiB:.0f} MiB "
                f"(VmHWM +{mem[0][1] / MiB:.0f})")


def measure_blocking(b: Bench, repeats: int, res: dict) -> None:
    """3a: how long trainer.save() blocks, async off vs on."""
    for r in range(repeats):
        for which in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
            if which == "sync":
                w, mem = measure(lambda: b.trainer_save(b.ck_sync))
                clear(b.tmp / "ckpt-sync")
            else:
                w, mem = measure(lambda: b.trainer_save(b.ck_async), b.wait_async)
                clear(b.tmp / "ckpt-async")
            res[f"blk_{which}"].append((w, mem))
            extra = f" + {w[1]:.2f} s until written" if which == "async" else ""
            say(f"[{r + 1}/{repeats}] trainer.save() async={'on' if which == 'async' else 'off':>3}: "
                f"returns after {w[0]:6.2f} s{extra}, rank-0 RSS +{mem[0][0] / MiB:.0f} MiB")


VARIANTS = ["none", "sync", "async"]


def measure_loop(b: Bench, repeats: int, steps: int, res: dict) -> None:
    """3b: N training steps with a checkpoint in the middle (none / async off / async on, order rotating)."""
    half = steps // 2
    for r in range(repeats):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        for which in order:
            ck = b.ck_async if which == "async" else b.ck_sync
            w, _ = measure(lambda: b.train(steps, None if which == "none" else half, ck))
            clear(b.tmp / ("ckpt-async" if which == "async" else "ckpt-sync"))
            res[f"loop_{which}"].append(w[0])
            say(f"[{r + 1}/{repeats}] train() {steps} steps, save: {which:>5}: {w[0]:6.2f} s")


# -- report ----------------------------------------------------------------------------------------

class Figures:
    """The medians over repeats the report prints."""

    def __init__(self, res: dict, world: int) -> None:
        med = statistics.median
        self.res, self.world = res, world
        self.dcp_t, self.full_t = med(x[0] for x in res["dcp"]), med(x[0] for x in res["full"])
        self.blk_sync = med(x[0][0] for x in res["blk_sync"])
        self.blk_async = med(x[0][0] for x in res["blk_async"])
        self.async_write = med(x[0][1] for x in res["blk_async"])
        self.loop = {v: med(res[f"loop_{v}"]) for v in VARIANTS}
        # Paired: each repeat's save variant minus the same repeat's no-save run (load from elsewhere drifts).
        self.delta = {v: med(a - b for a, b in zip(res[f"loop_{v}"], res["loop_none"])) for v in ("sync", "async")}

    def mem_med(self, key: str, rk: int, i: int) -> float:
        return statistics.median(x[1][rk][i] for x in self.res[key]) / MiB

    def mem_cells(self, key: str) -> str:
        cells = f"{self.mem_med(key, 0, 0):>9.0f} {self.mem_med(key, 0, 1):>9.0f}"
        if self.world > 1:
            cells += f" {max(self.mem_med(key, k, 0) for k in range(1, self.world)):>9.0f}"
        return cells


def header_lines(b: Bench, args, z: Sizes) -> list[str]:
    """The setup: machine, model, state sizes, how it was measured."""
    mc, cfg, world = b.trainer.model_cfg, b.cfg, dist.get_world_size()
    return [
        f"shardlm checkpoint benchmark: {world} ranks, gloo on cpu ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores), {torch.get_num_threads()} thread/rank, torch {torch.__version__}, "
        f"checkpoints on {b.tmp.parent} (temp dir)",
        f"model debug preset + {' '.join(a[2:] for a in MODEL[1:])}: {mc.num_params() / 1e6:.2f}M params, fp32; "
        f"seq_len {cfg.data.seq_len} x micro_batch {cfg.train.micro_batch_size} x dp {b.trainer.dims.dp}",
        f"state = params + 2 AdamW moments (+ step): full {z.full_b / MiB:.0f} MiB, rank-0 shard "
        f"{z.shard_b[0] / MiB:.0f} MiB (ranks: {', '.join(f'{x / MiB:.0f}' for x in z.shard_b)} MiB); on disk: "
        f"DCP {z.dcp_disk / MiB:.0f} MiB (all ranks' files), full torch.save {z.full_disk / MiB:.0f} MiB",
        f"{args.repeats} repeats of each measurement, order alternating; medians. Times: the slowest rank's, from a "
        "common barrier. RSS added: peak minus RSS just before (sampled every 5 ms from a thread; VmHWM = the "
        "kernel's peak since a clear_refs reset), MiB; r1+ = the highest of the other ranks.",
        "",
    ]


def table_lines(f: Figures, args, z: Sizes) -> list[str]:
    """Tables 1+2, 3a, 3b and every repeat's figures."""
    half = args.steps // 2
    return [
        "1+2. save of model + optimizer (+ trainer state), blocking",
        f"  {'':<44} {'time s':>7} {'r0 RSS+':>9} {'r0 VmHWM+':>9}" + (f" {'r1+ RSS+':>9}" if f.world > 1 else ""),
        f"  {'DCP Checkpointer.save (sharded, fsync)':<44} {f.dcp_t:>7.2f} {f.mem_cells('dcp')}",
        f"  {'full state dict -> rank-0 torch.save (fsync)':<44} {f.full_t:>7.2f} {f.mem_cells('full')}",
        f"  {'DCP async save (staging + write, for ref.)':<44} {f.blk_async + f.async_write:>7.2f} "
        f"{f.mem_cells('blk_async')}",
        f"  {'reference: rank-0 shard / full state':<44} {'':>7} {z.shard_b[0] / MiB:>9.0f} {z.full_b / MiB:>9.0f}",
        "",
        "3a. training blocked by trainer.save()",
        f"  {'async off: returns after (whole DCP save)':<44} {f.blk_sync:>7.2f} s",
        f"  {'async on:  returns after (staging copy)':<44} {f.blk_async:>7.2f} s",
        f"  {'async on:  write done later (wait() at once)':<44} {f.async_write:>7.2f} s",
        "",
        f"3b. Trainer.train() for {args.steps} steps, checkpoint after step {half} (time includes it on disk)",
        f"  {'no save':<44} {f.loop['none']:>7.2f} s",
        f"  {'async off':<44} {f.loop['sync']:>7.2f} s  (paired, minus the same repeat's no-save run: "
        f"{f.delta['sync']:+.2f} s)",
        f"  {'async on':<44} {f.loop['async']:>7.2f} s  (paired, minus the same repeat's no-save run: "
        f"{f.delta['async']:+.2f} s)",
        "",
        "per repeat (s): " + "; ".join(
            f"{k} " + ", ".join(f"{(x[0] if k in ('dcp', 'full') else x[0][0] if k.startswith('blk') else x):.2f}"
                                for x in v) for k, v in f.res.items()),
        "",
    ]


def summary_lines(f: Figures, args, z: Sizes) -> list[str]:
    """The findings, one line each."""
    shard, full = z.shard_b[0] / MiB, z.full_b / MiB
    return [
        f"save time: DCP {f.dcp_t:.2f} s vs full-state-dict torch.save {f.full_t:.2f} s ({f.full_t / f.dcp_t:.2f}x)",
        f"rank-0 RSS added: DCP blocking +{f.mem_med('dcp', 0, 0):.0f} MiB, DCP async "
        f"+{f.mem_med('blk_async', 0, 0):.0f} MiB, full state dict +{f.mem_med('full', 0, 0):.0f} MiB (rank-0 shard "
        f"{shard:.0f} MiB, full {full:.0f} MiB)",
        f"trainer.save() blocks the loop: async off {f.blk_sync:.2f} s, async on {f.blk_async:.2f} s "
        f"({f.blk_sync / f.blk_async:.1f}x less; the write then takes {f.async_write:.2f} s more in the background)",
        f"{args.steps} steps with a save: no save {f.loop['none']:.2f} s, async off {f.loop['sync']:.2f} s "
        f"({f.delta['sync']:+.2f} paired), async on {f.loop['async']:.2f} s ({f.delta['async']:+.2f} paired)",
    ]


if __name__ == "__main__":
    main()
