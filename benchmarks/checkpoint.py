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
    rank, world = dist.get_rank(), dist.get_world_size()
    rank0 = rank == 0
    tmp = shared_tmpdir("shardlm-ckpt-bench-", "/tmp",
                        fill=lambda d: write_corpus(d / "corpus.jsonl", CORPUS_BYTES))
    log = open(tmp / f"trainer-rank{rank}.log", "w")

    cfg = load_config(None, [
        *MODEL, "--train.mixed_precision=fp32", "--train.device=cpu", "--train.micro_batch_size=1",
        "--train.grad_accum=1", "--train.steps=100000", f"--train.output_dir={tmp / 'run'}",
        "--data.seq_len=64", f"--data.path={tmp / 'corpus.jsonl'}", f"--data.cache_dir={tmp / 'cache'}",
        "--metrics.progress_bar=false", "--metrics.log_every=100000",
        "--checkpoint.save_final=false", "--checkpoint.resume=none", "--checkpoint.interval=0",
        "--checkpoint.keep_last=0", "--checkpoint.async=false", f"--checkpoint.dir={tmp / 'ckpt-sync'}",
    ])
    with contextlib.redirect_stdout(log):
        trainer = Trainer(cfg)
        ck_sync = trainer.checkpointer
        ck_async = Checkpointer(dataclasses.replace(cfg.checkpoint, async_=True, dir=str(tmp / "ckpt-async")),
                                tmp / "ckpt-async", rank, trainer.model, trainer.optimizer,
                                {"trainer": trainer.state}, log=trainer.log)
    model, opt = trainer.model, trainer.optimizer

    def train(n: int, save_at: int | None, ck: Checkpointer) -> None:
        """One Trainer.train() call of n more steps, a checkpoint after step trainer.step + save_at."""
        s = trainer.step
        if save_at is not None and s == 0:
            raise RuntimeError("place the save by interval needs trainer.step > 0 (run a warmup first)")
        # interval = s + save_at: its only multiple in (s, s + n] is s + save_at (2 * interval > s + n).
        c = dataclasses.replace(cfg.checkpoint, interval=0 if save_at is None else s + save_at)
        trainer.cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=s + n), checkpoint=c)
        trainer.metrics = MetricsLogger(trainer.output_dir, s + n, rank0, False, False, start_step=s)
        trainer.checkpointer = ck
        with contextlib.redirect_stdout(log):
            trainer.train()

    step_id = [10**6]  # step numbers for direct saves, never clashing with training steps

    def dcp_save() -> None:
        step_id[0] += 1
        with contextlib.redirect_stdout(log):
            ck_sync.save(step_id[0], blocking=True)

    full_file = tmp / "full.pt"
    full_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def full_save() -> None:
        msd = get_model_state_dict(model, options=full_opts)
        osd = get_optimizer_state_dict(model, opt, options=full_opts)
        if rank0:
            with open(full_file, "wb") as f:
                torch.save({"model": msd, "optim": osd, "trainer": trainer.state.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
        del msd, osd
        dist.barrier()

    def trainer_save(ck: Checkpointer) -> None:
        trainer.checkpointer = ck
        with contextlib.redirect_stdout(log):
            trainer.save()

    def wait_async() -> None:
        with contextlib.redirect_stdout(log):
            ck_async.wait()

    # -- warmup (untimed): optimizer state exists, every code path ran once ---------------------
    say("warmup ...")
    t0 = time.perf_counter()
    train(2, None, ck_sync)
    step_time = (time.perf_counter() - t0) / 2
    local_b, full_b = local_and_full_bytes(state_tensors(model, opt))
    shard_b = [int(x[0]) for x in gather([float(local_b)])]
    dcp_save()
    dcp_disk = du(tmp / "ckpt-sync") if rank0 else 0
    clear(tmp / "ckpt-sync")
    full_save()
    full_disk = du(full_file) if rank0 else 0
    clear(full_file)
    trainer_save(ck_async)
    wait_async()
    clear(tmp / "ckpt-async")
    say(f"warmup done ({step_time:.2f} s/step incl. first-step costs); shard {shard_b[0] / MiB:.0f} MiB, "
        f"full {full_b / MiB:.0f} MiB")

    # -- 1 + 2: save time and RSS, DCP vs full state dict -------------------------------------------
    res: dict[str, list] = {k: [] for k in ("dcp", "full", "blk_sync", "blk_async", "loop_none", "loop_sync",
                                            "loop_async")}
    for r in range(args.repeats):
        for which in (("dcp", "full") if r % 2 == 0 else ("full", "dcp")):
            if which == "dcp":
                w, mem = measure(dcp_save)
                clear(tmp / "ckpt-sync")
            else:
                w, mem = measure(full_save)
                clear(full_file)
            res[which].append((w[0], mem))
            say(f"[{r + 1}/{args.repeats}] {which:>4} save {w[0]:6.2f} s, rank-0 RSS +{mem[0][0] / MiB:.0f} MiB "
                f"(VmHWM +{mem[0][1] / MiB:.0f})")

    # -- 3a: how long trainer.save() blocks, async off vs on ---------------------------------------
    for r in range(args.repeats):
        for which in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
            if which == "sync":
                w, mem = measure(lambda: trainer_save(ck_sync))
                clear(tmp / "ckpt-sync")
            else:
                w, mem = measure(lambda: trainer_save(ck_async), wait_async)
                clear(tmp / "ckpt-async")
            res[f"blk_{which}"].append((w, mem))
            extra = f" + {w[1]:.2f} s until written" if which == "async" else ""
            say(f"[{r + 1}/{args.repeats}] trainer.save() async={'on' if which == 'async' else 'off':>3}: "
                f"returns after {w[0]:6.2f} s{extra}, rank-0 RSS +{mem[0][0] / MiB:.0f} MiB")

    # -- 3b: N training steps with a checkpoint in the middle -------------------------------------
    half = args.steps // 2
    variants = ["none", "sync", "async"]
    for r in range(args.repeats):
        order = variants[r % 3:] + variants[:r % 3]
        for which in order:
            ck = ck_async if which == "async" else ck_sync
            w, _ = measure(lambda: train(args.steps, None if which == "none" else half, ck))
            clear(tmp / ("ckpt-async" if which == "async" else "ckpt-sync"))
            res[f"loop_{which}"].append(w[0])
            say(f"[{r + 1}/{args.repeats}] train() {args.steps} steps, save: {which:>5}: {w[0]:6.2f} s")

    # -- report ------------------------------------------------------------------------------------
    med = statistics.median
    dcp_t, full_t = med(x[0] for x in res["dcp"]), med(x[0] for x in res["full"])

    def mem_med(key: str, rk: int, i: int) -> float:
        return med(x[1][rk][i] for x in res[key]) / MiB

    blk_sync = med(x[0][0] for x in res["blk_sync"])
    blk_async = med(x[0][0] for x in res["blk_async"])
    async_write = med(x[0][1] for x in res["blk_async"])
    loop = {v: med(res[f"loop_{v}"]) for v in variants}
    # Paired: each repeat's save variant minus the same repeat's no-save run (load from elsewhere drifts).
    delta = {v: med(a - b for a, b in zip(res[f"loop_{v}"], res["loop_none"])) for v in ("sync", "async")}
    mc = trainer.model_cfg
    others = range(1, world)

    def mem_cells(key: str) -> str:
        cells = f"{mem_med(key, 0, 0):>9.0f} {mem_med(key, 0, 1):>9.0f}"
        if world > 1:
            cells += f" {max(mem_med(key, k, 0) for k in others):>9.0f}"
        return cells

    lines = [
        f"shardlm checkpoint benchmark: {world} ranks, gloo on cpu ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores), {torch.get_num_threads()} thread/rank, torch {torch.__version__}, "
        f"checkpoints on {tmp.parent} (temp dir)",
        f"model debug preset + {' '.join(a[2:] for a in MODEL[1:])}: {mc.num_params() / 1e6:.2f}M params, fp32; "
        f"seq_len {cfg.data.seq_len} x micro_batch {cfg.train.micro_batch_size} x dp {trainer.dims.dp}",
        f"state = params + 2 AdamW moments (+ step): full {full_b / MiB:.0f} MiB, rank-0 shard "
        f"{shard_b[0] / MiB:.0f} MiB (ranks: {', '.join(f'{b / MiB:.0f}' for b in shard_b)} MiB); on disk: "
        f"DCP {dcp_disk / MiB:.0f} MiB (all ranks' files), full torch.save {full_disk / MiB:.0f} MiB",
        f"{args.repeats} repeats of each measurement, order alternating; medians. Times: the slowest rank's, from a "
        "common barrier. RSS added: peak minus RSS just before (sampled every 5 ms from a thread; VmHWM = the "
        "kernel's peak since a clear_refs reset), MiB; r1+ = the highest of the other ranks.",
        "",
        "1+2. save of model + optimizer (+ trainer state), blocking",
        f"  {'':<44} {'time s':>7} {'r0 RSS+':>9} {'r0 VmHWM+':>9}" + (f" {'r1+ RSS+':>9}" if world > 1 else ""),
        f"  {'DCP Checkpointer.save (sharded, fsync)':<44} {dcp_t:>7.2f} {mem_cells('dcp')}",
        f"  {'full state dict -> rank-0 torch.save (fsync)':<44} {full_t:>7.2f} {mem_cells('full')}",
        f"  {'DCP async save (staging + write, for ref.)':<44} {blk_async + async_write:>7.2f} {mem_cells('blk_async')}",
        f"  {'reference: rank-0 shard / full state':<44} {'':>7} {shard_b[0] / MiB:>9.0f} {full_b / MiB:>9.0f}",
        "",
        "3a. training blocked by trainer.save()",
        f"  {'async off: returns after (whole DCP save)':<44} {blk_sync:>7.2f} s",
        f"  {'async on:  returns after (staging copy)':<44} {blk_async:>7.2f} s",
        f"  {'async on:  write done later (wait() at once)':<44} {async_write:>7.2f} s",
        "",
        f"3b. Trainer.train() for {args.steps} steps, checkpoint after step {half} (time includes it on disk)",
        f"  {'no save':<44} {loop['none']:>7.2f} s",
        f"  {'async off':<44} {loop['sync']:>7.2f} s  (paired, minus the same repeat's no-save run: "
        f"{delta['sync']:+.2f} s)",
        f"  {'async on':<44} {loop['async']:>7.2f} s  (paired, minus the same repeat's no-save run: "
        f"{delta['async']:+.2f} s)",
        "",
        "per repeat (s): " + "; ".join(
            f"{k} " + ", ".join(f"{(x[0] if k in ('dcp', 'full') else x[0][0] if k.startswith('blk') else x):.2f}"
                                for x in v) for k, v in res.items()),
        "",
        f"save time: DCP {dcp_t:.2f} s vs full-state-dict torch.save {full_t:.2f} s ({full_t / dcp_t:.2f}x)",
        f"rank-0 RSS added: DCP blocking +{mem_med('dcp', 0, 0):.0f} MiB, DCP async +{mem_med('blk_async', 0, 0):.0f} "
        f"MiB, full state dict +{mem_med('full', 0, 0):.0f} MiB (rank-0 shard {shard_b[0] / MiB:.0f} MiB, "
        f"full {full_b / MiB:.0f} MiB)",
        f"trainer.save() blocks the loop: async off {blk_sync:.2f} s, async on {blk_async:.2f} s "
        f"({blk_sync / blk_async:.1f}x less; the write then takes {async_write:.2f} s more in the background)",
        f"{args.steps} steps with a save: no save {loop['none']:.2f} s, async off {loop['sync']:.2f} s "
        f"({delta['sync']:+.2f} paired), async on {loop['async']:.2f} s ({delta['async']:+.2f} paired)",
    ]
    if rank0:
        report(lines, RESULT if args.save else None)

    with contextlib.redirect_stdout(log):
        ck_async.close()
        trainer.checkpointer = ck_sync
        trainer.close()  # closes ck_sync and the default group
    log.close()
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
