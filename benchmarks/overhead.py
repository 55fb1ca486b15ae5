"""How much does shardlm's training loop cost over a minimal hand-written FSDP2 loop?

    torchrun --standalone --nproc_per_node 2 benchmarks/overhead.py [--steps N] [--rounds R] [--save]

Both loops run in ONE process group, on the same 2 ranks, on the same model shape (configs/debug.toml:
debug preset, fp32, seq_len 128, micro_batch_size 8, grad_accum 1) and on the same sequence of batches
(two PackedLoaders over the same token file, same seed, same dp rank), CPU + gloo, one thread per rank.

(A) shardlm: a `Trainer` built from configs/debug.toml (metrics.log_every=10 as shipped, progress bar
    off). What is timed is whole `Trainer.train()` calls, nothing around them: data loading
    (`PackedLoader.next_step`), the per-step token-count all-reduce, `set_requires_gradient_sync`,
    forward/backward, shardlm's clip_grad_norm_ (norm all-reduce), AdamW, the LR scheduler, every
    log_every steps the loss all-reduce + .item() syncs + metrics.jsonl write + log line, and each
    call's own start/"done" lines. (Rank 0's lines go to a file in the temp dir, not the terminal, to
    keep this output readable: one flushed write() per line, as with a pipe.) Each call runs
    `--chunk` more steps (train.steps raised accordingly); with the default chunk = log_every the log
    lines fall where a real run has them, plus two extra lines per call, so if anything (A) is charged
    a little more than a real run pays. The LR schedule keeps the length of the whole benchmark (its
    lambda holds the original TrainSection): the schedule of one real run.
(B) minimal: `Transformer` on meta, `fully_shard` each block, the embedding and the head, then the root
    (the units shardlm makes, the same fp32 MixedPrecisionPolicy and reshard_after_forward as shardlm's: every
    block but the last, the embedding; not the head nor the root), `to_empty`, `init_weights`, `torch.optim.AdamW` (same lr/betas/eps/weight decay, decay on
    matrices only, like shardlm), then per step: fetch the batch from its PackedLoader (inside the
    timed loop), forward, F.cross_entropy mean, backward, torch.nn.utils.clip_grad_norm_ (same max
    norm), opt.step(), opt.zero_grad(). No LR schedule, no logging, no token count.

Checkpointing, where shardlm has it, is off (no periodic or final save, no resume): the figure is
steady-state training throughput, and (A) is split into several train() calls (below).

Both warm up for --warmup steps first (untimed). Then R rounds; in each, both loops run N timed steps,
as chunks of --chunk steps alternating A,B / B,A / ... (default 10: a burst of load from elsewhere on
a shared machine then hits both alike; --chunk N gives one A block and one B block per round, the
order alternating by round). Each timed piece starts after a barrier (and a gc.collect() before it);
its time is the slowest rank's. A round's tokens/s = N x global batch x seq_len / the sum of its
pieces' times. The ratio reported is the median of the per-round ratios A/B. Alongside, the same
ratio by CPU time (B's CPU-seconds over A's, summed over ranks and threads): on a machine that
others are loading it moves much less than wall time, but it does not see time spent waiting
(e.g. in collectives), so the wall-clock ratio is the figure; the CPU one is a noise check.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import ROOT, report, shared_tmpdir, write_corpus
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from shardlm.config import Config, load_config
from shardlm.data.loader import PackedLoader
from shardlm.distributed.env import shutdown_distributed
from shardlm.models import Transformer
from shardlm.observe.metrics import MetricsLogger
from shardlm.parallel.dims import dp_rank
from shardlm.parallel.fsdp import DTYPES, shard_view
from shardlm.train.trainer import Trainer

CONFIG = ROOT / "configs" / "debug.toml"
RESULT = Path(__file__).resolve().parent / "results" / "overhead_cpu.txt"
TARGET = 0.97
CORPUS_BYTES = 2 << 20


def no_checkpoint_overrides() -> list[str]:
    """Where this shardlm has a [checkpoint] section: no saves, no resume inside the timed train() calls."""
    section = {f.name: f.default_factory for f in dataclasses.fields(Config)}.get("checkpoint")
    if section is None:
        return []
    keys = {f.metadata.get("key", f.name) for f in dataclasses.fields(section)}  # type: ignore[arg-type]
    wanted = {"interval": "0", "save_final": "false", "resume": "none"}
    return [f"--checkpoint.{k}={v}" for k, v in wanted.items() if k in keys]


class Minimal:
    """(B): the loop one would write by hand with FSDP2 and nothing else."""

    def __init__(self, trainer: Trainer):
        cfg, t = trainer.cfg, trainer.cfg.train
        self.device = trainer.env.device
        with torch.device("meta"):
            model = Transformer(trainer.model_cfg)
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[t.mixed_precision], reduce_dtype=DTYPES[t.reduce_dtype])
        reshard, n = cfg.parallel.reshard_after_forward, len(model.layers)
        k = trainer.model.fsdp_choices.unsharded  # the last k blocks keep their parameters, as the trainer's do
        for i, block in enumerate(model.layers):
            fully_shard(block, mesh=trainer.mesh, mp_policy=mp, reshard_after_forward=i < n - k)
        if model.lm_head is not None:  # the trainer's units: the untied embedding and the head on their own
            fully_shard(model.embed_tokens, mesh=trainer.mesh, mp_policy=mp, reshard_after_forward=reshard is not False)
            fully_shard(model.lm_head, mesh=trainer.mesh, mp_policy=mp, reshard_after_forward=False)
        fully_shard(model, mesh=trainer.mesh, mp_policy=mp)
        model.to_empty(device=self.device)
        model.init_weights(seed=t.seed, shard_view=shard_view)
        self.model = model
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
        self.max_norm = t.grad_clip
        d = cfg.data
        # Same token store (prepared by the Trainer), same seed, same dp rank: same batches as (A).
        self.loader = PackedLoader(trainer.stores[0].tokens, seq_len=d.seq_len, micro_batch_size=t.micro_batch_size,
                                   grad_accum=t.grad_accum, dp_rank=dp_rank(trainer.mesh), dp_size=trainer.dims.dp,
                                   seed=t.seed, shuffle=d.shuffle)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            (x, y), = self.loader.next_step()
            x, y = x.to(self.device), y.to(self.device)
            logits = self.model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
            self.opt.step()
            self.opt.zero_grad()


def prepare_shardlm(trainer: Trainer, base_cfg, steps: int) -> None:
    """Untimed set-up of the next Trainer.train() call: `steps` more steps, a fresh MetricsLogger
    (the previous call's finish() closed it). The scheduler keeps base_cfg.train (the full length)."""
    trainer.cfg = dataclasses.replace(base_cfg, train=dataclasses.replace(base_cfg.train, steps=trainer.step + steps))
    trainer.report.open(MetricsLogger(trainer.output_dir, trainer.cfg.train.steps, trainer.is_rank0,
                                      base_cfg.metrics.progress_bar, base_cfg.metrics.tensorboard), None)


def timed(fn) -> tuple[float, float]:
    """(wall seconds of the slowest rank, CPU seconds of all ranks) of `fn()`, started from a barrier."""
    gc.collect()
    dist.barrier()
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    c, w = time.process_time() - c0, time.perf_counter() - w0
    wall, cpu = torch.tensor(w, dtype=torch.float64), torch.tensor(c, dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return wall.item(), cpu.item()


def measure_guard(trainer: Trainer, base_cfg, steps: int, log) -> dict:
    """Collectives per step of Trainer.train() (counted by wrapping torch.distributed) and the time of
    the step's norm all-reduce + clip + the guard's host read (wrapping the trainer's clip_grad_norm_)."""
    import shardlm.train.trainer as T

    counts: dict[str, int] = {}
    clip_s = [0.0]
    wrapped = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast", "reduce_scatter_tensor")}

    def counting(name, fn):
        def f(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return fn(*a, **k)
        return f

    real_clip = T.clip_grad_norm_

    def timed_clip(*a, **k):
        t0 = time.perf_counter()
        norm = real_clip(*a, **k)
        norm.item()  # the guard's read (the trainer reads it again: cached, the value is on the host)
        clip_s[0] += time.perf_counter() - t0
        return norm

    prepare_shardlm(trainer, base_cfg, steps)
    for name, fn in wrapped.items():
        setattr(dist, name, counting(name, fn))
    T.clip_grad_norm_ = timed_clip
    try:
        with contextlib.redirect_stdout(log):
            w0 = time.perf_counter()
            trainer.train()
            wall = time.perf_counter() - w0
    finally:
        for name, fn in wrapped.items():
            setattr(dist, name, fn)
        T.clip_grad_norm_ = real_clip
    logged = steps // base_cfg.metrics.log_every  # each logged step all-reduces the loss once more
    per_step = (sum(counts.values()) - logged) / steps
    by_op = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    return {"steps": steps, "collectives": per_step, "by_op": f"{by_op} in all, {logged} of them loss logging",
            "clip_ms": 1e3 * clip_s[0] / steps, "clip_share": clip_s[0] / wall}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="timed steps per round and per loop (default 60)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of A and B, order alternating (default 3)")
    ap.add_argument("--chunk", type=int, default=10,
                    help="steps per alternation inside a round, each chunk of (A) one Trainer.train() call "
                         "(default 10 = metrics.log_every; --chunk=STEPS runs each round as one A and one B block)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed warmup steps of each loop (default 10)")
    ap.add_argument("--save", action="store_true", help=f"also write the report to {RESULT.relative_to(ROOT)}")
    args = ap.parse_args()
    if min(args.steps, args.rounds, args.chunk) < 1 or args.warmup < 0:
        ap.error("--steps, --rounds and --chunk must be >= 1, --warmup >= 0")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    dist.init_process_group("gloo")  # the Trainer joins this group (init_distributed sees it initialised)
    rank0 = dist.get_rank() == 0
    tmp = shared_tmpdir("shardlm-overhead-",
                        fill=lambda d: write_corpus(d / "corpus.jsonl", CORPUS_BYTES, ("*.py", "*/*.py")))
    total = args.warmup + args.rounds * args.steps
    cfg = load_config(CONFIG, [
        "--model.preset=debug", "--train.mixed_precision=fp32", "--data.seq_len=128",
        "--train.micro_batch_size=8", "--train.grad_accum=1", "--metrics.log_every=10",
        "--metrics.progress_bar=false", "--train.device=cpu", f"--train.steps={total}",
        f"--train.output_dir={tmp / 'run'}", f"--data.cache_dir={tmp / 'cache'}",
        f"--data.path={tmp / 'corpus.jsonl'}", *no_checkpoint_overrides(),
    ])
    log = open(tmp / f"trainer-rank{dist.get_rank()}.log", "w")
    trainer = Trainer(cfg)
    minimal = Minimal(trainer)

    def shardlm(n: int) -> tuple[float, float]:
        prepare_shardlm(trainer, cfg, n)
        with contextlib.redirect_stdout(log):
            return timed(trainer.train)

    shardlm(args.warmup)
    timed(lambda: minimal.run(args.warmup))
    rows = run_rounds(args, shardlm, lambda n: timed(lambda: minimal.run(n)),
                      args.steps * trainer.loader.global_batch * cfg.data.seq_len)
    guard = measure_guard(trainer, cfg, args.chunk, log)
    if rank0:
        report(report_lines(args, trainer, cfg, rows, guard), RESULT if args.save else None)

    log.close()
    dist.barrier()
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
    shutdown_distributed()  # frees the gloo threads before interpreter shutdown


def run_rounds(args, shardlm, minimal, tokens: int) -> list[tuple]:
    """Each round: N steps of each loop, run as chunks of --chunk steps, A and B alternating chunk by chunk
    (A,B then B,A ...), so a burst of load from elsewhere hits both alike. -> per round (round, A tok/s,
    B tok/s, A/B, A/B by CPU time)."""
    chunks = [min(args.chunk, args.steps - i) for i in range(0, args.steps, args.chunk)]
    rows, k = [], 0
    for r in range(args.rounds):
        wall, cpu = {"A": 0.0, "B": 0.0}, {"A": 0.0, "B": 0.0}
        for n in chunks:
            for which in ("AB" if k % 2 == 0 else "BA"):
                w, c = shardlm(n) if which == "A" else minimal(n)
                wall[which] += w
                cpu[which] += c
            k += 1
        a, b = tokens / wall["A"], tokens / wall["B"]
        rows.append((r + 1, a, b, a / b, cpu["B"] / cpu["A"]))
        if dist.get_rank() == 0:
            print(f"round {r + 1}/{args.rounds}: shardlm {a:,.0f} tok/s, minimal {b:,.0f} tok/s, "
                  f"ratio {a / b:.3f} (CPU-time ratio {cpu['B'] / cpu['A']:.3f})", flush=True)
    return rows


def report_lines(args, trainer: Trainer, cfg, rows: list[tuple], guard: dict) -> list[str]:
    """The setup, one row per round and the medians, the overhead, the non-finite guard's cost."""
    mc = trainer.model_cfg
    med_a = statistics.median(r[1] for r in rows)
    med_b = statistics.median(r[2] for r in rows)
    ratio = statistics.median(r[3] for r in rows)
    cpu_ratio = statistics.median(r[4] for r in rows)
    lines = [
        f"shardlm overhead benchmark: {dist.get_world_size()} ranks, {trainer.env.backend} on "
        f"{trainer.env.device.type} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), "
        f"{torch.get_num_threads()} thread/rank, torch {torch.__version__}",
        f"model {cfg.model.preset} ({mc.num_params() / 1e6:.2f}M params, {cfg.train.mixed_precision}), "
        f"seq_len {cfg.data.seq_len} x micro_batch {cfg.train.micro_batch_size} x dp {trainer.dims.dp} = "
        f"{trainer.loader.global_batch * cfg.data.seq_len} tokens/step; "
        f"{args.rounds} rounds x {args.steps} timed steps per loop (alternating in chunks of {args.chunk}), "
        f"{args.warmup} warmup steps",
        "A = shardlm Trainer.train() (data, token all-reduce, fwd/bwd, clip, AdamW, LR schedule, "
        f"logging every {cfg.metrics.log_every})",
        "B = minimal FSDP2 loop (data, fwd/bwd, clip_grad_norm_, AdamW)",
        "A/B = wall-clock tokens/s ratio; A/B by CPU time = B's CPU-seconds / A's (both ranks, "
        "all threads): less sensitive to other load on the machine, blind to time spent waiting",
        "",
        f"{'round':>6}  {'A shardlm tok/s':>15}  {'B minimal tok/s':>15}  {'A/B':>6}  {'A/B by CPU time':>15}",
    ]
    for n, a, b, q, qc in rows:
        lines.append(f"{n:>6}  {a:>15,.0f}  {b:>15,.0f}  {q:>6.3f}  {qc:>15.3f}")
    lines.append(f"{'median':>6}  {med_a:>15,.0f}  {med_b:>15,.0f}  {ratio:>6.3f}  {cpu_ratio:>15.3f}")
    lines.append("")
    lines.append(f"overhead: shardlm / minimal = {ratio:.2f}x (target >= {TARGET:.2f}x)")
    lines.append("")
    lines.append(f"non-finite guard ({guard['steps']} more steps of A, counted): {guard['collectives']:.2f} collectives "
                 f"per step ({guard['by_op']}) = the token count + the grad norm, none of the guard's own (its flag "
                 f"rides on the norm's all-reduce); clip + flag + host read of the norm "
                 f"{guard['clip_ms']:.2f} ms/step = {guard['clip_share']:.1%} of the step")
    return lines


if __name__ == "__main__":
    main()
