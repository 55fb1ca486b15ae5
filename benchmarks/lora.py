"""LoRA vs full fine-tuning of an HF model, and shardlm's sharded HF load vs `from_pretrained`.

    torchrun --standalone --nproc_per_node 2 benchmarks/lora.py [--repeats R] [--steps N] [--warmup W] [--save]

One run, 2 gloo ranks on CPU (one thread per rank). Rank 0 first writes, to a temp dir under /tmp, an HF
Llama (transformers LlamaConfig: hidden 1024, --layers blocks (default 8), 8 heads, 4 KV heads,
intermediate 2816, vocab 8192, untied head; random init, fp32: 111M params, 424 MiB) with
`save_pretrained(max_shard_size="100MB")`, the tokenizer of `shardlm.demo_assets.make_tokenizer` (byte-level
BPE, vocab 512, chat template) and an SFT .jsonl of `demo_assets.sft_pairs` (stdlib signature -> docstring
line); the other rank waits (broadcast).

1. Training, LoRA vs full fine-tuning of that model: a `Trainer` (model.init_from=hf:<dir>, so every rank
   reads only its shards of the safetensors; data.format=sft, seq_len 128, micro batch 2, grad_accum 1, fp32,
   FSDP2 over both ranks, AdamW; no checkpointing, progress bar off) with
     LoRA  lora.rank=16, alpha=32, all 7 projections (q,k,v,o,gate,up,down): only the adapters train
           (embeddings, norms and head frozen), so AdamW holds moments for the adapters only;
     full  lora.rank=0: every parameter trains (grads + 2 AdamW moments for all of them).
   After one unmeasured warm-up build (a LoRA Trainer, 1 step: one-time costs of the process), each
   variant is built fresh (and thrown away) R times, order alternating (L,F / F,L / ...): per build, W
   untimed steps (the first allocates the optimizer state), then N timed steps as one `Trainer.train()`
   call started from a barrier, its time the slowest rank's; tokens/s = N x global batch x seq_len / that
   time. RSS is sampled (every 5 ms, from a thread, /proc/self/statm: `PeakRSS` in benchmarks/_common.py)
   from just before `Trainer(cfg)` to the end of the timed steps: "peak+" is the peak minus the RSS before
   the Trainer was built (after gc.collect + malloc_trim), "peak" the absolute peak, "HWM+" the kernel's
   VmHWM (reset through /proc/self/clear_refs at the start) minus the same baseline, "built+" the RSS right
   after the Trainer was built (model loaded, data tokenised) minus the baseline. Medians over the R builds.
2. HF load, same process, both ranks at once, R times alternating, medians:
     shardlm  `shardlm.build.build_model` (what the Trainer runs: Transformer on meta -> fully_shard each
              block + root -> to_empty -> init_weights -> `interop.hf.load.load_hf_weights`: every rank reads only its
              own rows of each tensor from the memory-mapped safetensors),
     HF       `transformers.AutoModelForCausalLM.from_pretrained(dir, dtype=float32)` of the same files,
              on EVERY rank (each rank builds the whole model, as a non-sharded loader does).
   Time: the slowest rank's, from a barrier. Then every parameter is read once (untimed "touch"):
   transformers 5 on CPU returns parameters that are lazy copy-on-write mmaps of the files, resident only
   once read. RSS: peak minus the RSS just before (over load + touch); "anon" = resident minus
   file-backed/shared pages (leaves out page-cache pages of the mmapped files); what is resident when
   the load returns and after the touch. Compared with the model's full size and the rank's shard (its
   local parameter bytes). The files were just written, so both read from the page cache.
   Once (untimed) the two loaded models' logits are compared on the same tokens, and rank 0's first
   build_model is split into init_weights and load_hf_weights time.

The temp dir (model, data, run output) is deleted at exit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
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
    gather,
    local_and_full_bytes,
    local_bytes,
    max_over_ranks,
    report,
    say,
    settle,
    shared_tmpdir,
    statm,
)
from torch.distributed.tensor import DTensor

from shardlm.config import load_config
from shardlm.distributed.env import shutdown_distributed
from shardlm.observe.metrics import MetricsLogger
from shardlm.parallel.dims import ParallelDims
from shardlm.build import build_model, build_model_config
from shardlm.train.trainer import Trainer

RESULT = Path(__file__).resolve().parent / "results" / "lora_cpu.txt"
LORA_RANK, LORA_ALPHA = 16, 32
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
SFT_PAIRS = 600  # ~150 packed rows of 128: more than the run consumes (and it wraps around anyway)


# -- assets ----------------------------------------------------------------------------------------

def make_hf_model(out: Path, n_layers: int) -> None:
    """The HF Llama, sharded safetensors (fp32), + demo tokenizer (vocab 512 < the model's 8192)."""
    import transformers

    from shardlm.assets.debug_hf import make_tokenizer

    out.mkdir(parents=True)
    make_tokenizer(out)
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id("<|endoftext|>")
    cfg = transformers.LlamaConfig(hidden_size=1024, num_hidden_layers=n_layers, num_attention_heads=8,
                                   num_key_value_heads=4, intermediate_size=2816, vocab_size=8192,
                                   max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   eos_token_id=eos, bos_token_id=eos)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float()
    model.save_pretrained(out, max_shard_size="100MB", safe_serialization=True)
    del model


def write_assets(d: Path, n_layers: int) -> None:
    """The HF model and the SFT data, into d (rank 0, before the others go on)."""
    from shardlm.assets.debug_hf import sft_pairs

    make_hf_model(d / "model", n_layers)
    (d / "sft.jsonl").write_text("".join(json.dumps(p) + "\n" for p in sft_pairs(SFT_PAIRS)))


# -- benchmark -------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="builds of each variant, order alternating (default 2)")
    ap.add_argument("--steps", type=int, default=6, help="timed training steps per build (default 6: ~10-15 s a step on 2 loaded cores)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed training steps per build first (default 2)")
    ap.add_argument("--layers", type=int, default=8, help="transformer blocks of the HF model (default 8)")
    ap.add_argument("--save", action="store_true", help=f"also write the report to {RESULT.relative_to(ROOT)}")
    args = ap.parse_args()
    if min(args.repeats, args.steps, args.warmup, args.layers) < 1:
        ap.error("--repeats, --steps, --warmup and --layers must be >= 1")

    torch.set_num_threads(1)  # 2 ranks on 2 cores
    dist.init_process_group("gloo")  # the Trainer joins this group (init_distributed sees it initialised)
    rank, world = dist.get_rank(), dist.get_world_size()
    rank0 = rank == 0
    t_start = time.perf_counter()

    say(f"writing the HF model ({args.layers} layers) and SFT data ...")
    tmp = shared_tmpdir("shardlm-lora-bench-", "/tmp", fill=lambda d: write_assets(d, args.layers))
    try:
        run(args, tmp, rank, world, t_start)
    finally:
        dist.barrier()
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        shutdown_distributed()  # frees the gloo threads before interpreter shutdown


def run(args, tmp: Path, rank: int, world: int, t_start: float) -> None:
    """The two measurements (the HF load first: cheap), then the report on rank 0."""
    model_dir = tmp / "model"
    log = open(tmp / f"trainer-rank{rank}.log", "w")
    st_files = sorted(model_dir.glob("*.safetensors"))
    disk_bytes = sum(p.stat().st_size for p in st_files)
    say(f"  {len(st_files)} safetensors files, {disk_bytes / MiB:.0f} MiB ({time.perf_counter() - t_start:.0f} s)")
    cfgs = train_configs(tmp, model_dir)
    loads = measure_loads(args, cfgs["full"], model_dir, world, log)
    train_res, info = measure_training(args, cfgs, rank == 0, log)
    log.close()
    if rank == 0:
        res = Results(args, world, len(st_files), disk_bytes, t_start, loads, train_res, info)
        report([*header_lines(res), *training_lines(res), *load_lines(res), *summary_lines(res)],
               RESULT if args.save else None)


def train_configs(tmp: Path, model_dir: Path) -> dict:
    """The Trainer configs of the two variants: LoRA and full fine-tuning, otherwise the same."""
    common = [
        f"--model.init_from=hf:{model_dir}", "--data.format=sft", f"--data.path={tmp / 'sft.jsonl'}",
        f"--data.cache_dir={tmp / 'cache'}", "--data.seq_len=128", "--train.micro_batch_size=2",
        "--train.grad_accum=1", "--train.mixed_precision=fp32", "--train.device=cpu", "--train.steps=100000",
        "--train.warmup_steps=2", "--train.lr=1e-4", f"--train.output_dir={tmp / 'run'}",
        "--metrics.progress_bar=false", "--metrics.log_every=100000",
        "--checkpoint.save_final=false", "--checkpoint.resume=none", "--checkpoint.interval=0",
        f"--checkpoint.dir={tmp / 'ckpt'}",
    ]
    return {
        "lora": load_config(None, [*common, f"--lora.rank={LORA_RANK}", f"--lora.alpha={LORA_ALPHA}",
                                   f"--lora.targets={TARGETS}"]),
        "full": load_config(None, [*common, "--lora.rank=0"]),
    }


# -- 2. HF load: shardlm's sharded build_model vs from_pretrained ----------------------------------------

@dataclasses.dataclass
class Loads:
    """What the HF-load part measured: the first build's breakdown, the logits check, the timed loads."""

    parts: dict  # rank 0's first build_model: its time, init_weights' and load_hf_weights' (s)
    full_b: int  # the model's full bytes
    shards: list  # each rank's local parameter bytes
    diff: float  # max |logits difference| over ranks
    scale: float  # max |logit|
    res: dict  # "shardlm" | "hf" -> per load: (wall s, per-rank memory, touch s)


@torch.no_grad()
def touch(model) -> None:
    """Read every parameter once (from_pretrained's are lazy views of the mmapped files)."""
    for p in model.parameters():
        (p.to_local() if isinstance(p, DTensor) else p).sum()


def measure_loads(args, cfg, model_dir: Path, world: int, log) -> Loads:
    """The untimed check, then each loader R times, order alternating."""
    import transformers

    with contextlib.redirect_stdout(log):
        from shardlm.data import load_tokenizer
        from shardlm.resolve import tokenizer_spec

        tok = load_tokenizer(tokenizer_spec(cfg))
    mc = build_model_config(cfg, tok.vocab_size)
    mesh = ParallelDims(1, -1, world).build_mesh("cpu")
    device = torch.device("cpu")
    loaders = {"shardlm": lambda: build_model(cfg, mc, mesh, device),
               "hf": lambda: transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)}
    checked = check_loads(loaders, tok.vocab_size)
    res: dict[str, list] = {"shardlm": [], "hf": []}
    for r in range(args.repeats):
        for which in (("shardlm", "hf") if r % 2 == 0 else ("hf", "shardlm")):
            wall, mem, touch_s = measure_load(loaders[which])
            res[which].append((wall, mem, touch_s))
            say(f"  [{r + 1}/{args.repeats}] load {which:>7}: {wall:6.2f} s (+ {touch_s:.2f} s reading every "
                "parameter), RSS + per rank " + ", ".join(f"{x[0] / MiB:.0f}" for x in mem) + " MiB (anon + "
                + ", ".join(f"{x[1] / MiB:.0f}" for x in mem) + ")")
    return Loads(**checked, res=res)


def timed_first_build(load_shardlm) -> tuple[dict, torch.nn.Module]:
    """(rank 0's time of build_model and of its init_weights and load_hf_weights, the model built)."""
    import shardlm.interop.hf.load as hf_io
    from shardlm.models import Transformer

    parts = {"init_weights": 0.0, "load_hf_weights": 0.0}

    def timed_part(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[name] += time.perf_counter() - t0
        return wrapper

    orig_init, orig_load = Transformer.init_weights, hf_io.load_hf_weights
    Transformer.init_weights = timed_part("init_weights", orig_init)
    hf_io.load_hf_weights = timed_part("load_hf_weights", orig_load)
    try:
        t0 = time.perf_counter()
        ours = load_shardlm()
        parts["build_model"] = time.perf_counter() - t0
    finally:
        Transformer.init_weights, hf_io.load_hf_weights = orig_init, orig_load
    return dict(zip(parts, gather([parts[k] for k in parts])[0])), ours  # rank 0's


def check_loads(loaders: dict, vocab_size: int) -> dict:
    """Untimed: the two loads agree (same logits on the same tokens); where build_model's time goes."""
    parts, ours = timed_first_build(loaders["shardlm"])
    theirs = loaders["hf"]()
    shard_b, full_b = local_and_full_bytes(list(ours.parameters()))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (2, 32), generator=g)
    with torch.no_grad():
        ref = theirs(ids).logits
        diff = (ours(ids) - ref).abs().max().item()
        scale = ref.abs().max().item()
    diff = max_over_ranks(diff)
    del ours, theirs, ref
    shards = [int(x[0]) for x in gather([float(shard_b)])]
    say(f"  logits check: shardlm-loaded vs from_pretrained max |diff| {diff:.2e} (max |logit| {scale:.2f}); "
        f"rank-0 build_model {parts['build_model']:.2f} s of which init_weights {parts['init_weights']:.2f} s, "
        f"load_hf_weights {parts['load_hf_weights']:.2f} s")
    return {"parts": parts, "full_b": full_b, "shards": shards, "diff": diff, "scale": scale}


def measure_load(load) -> tuple[float, list, float]:
    """One load on every rank from a barrier: (slowest wall s, per-rank memory, slowest touch s)."""
    settle()
    dist.barrier()
    with PeakRSS() as m:
        t0 = time.perf_counter()
        model = load()
        wall = time.perf_counter() - t0
        loaded = statm()
        t0 = time.perf_counter()
        touch(model)
        touch_s = time.perf_counter() - t0
        kept, kept_anon = statm()
    wall, touch_s = max_over_ranks(wall), max_over_ranks(touch_s)
    mem = gather([m.peak - m.base, m.peak_anon - m.base_anon, kept - m.base, kept_anon - m.base_anon,
                  loaded[0] - m.base])
    del model
    settle()
    return wall, mem, touch_s


# -- 1. training: LoRA vs full fine-tuning ---------------------------------------------------------------

def train_call(trainer: Trainer, n: int, rank0: bool) -> None:
    """One Trainer.train() call of n more steps (train.steps raised, a fresh MetricsLogger)."""
    s = trainer.step
    trainer.cfg = dataclasses.replace(trainer.cfg, train=dataclasses.replace(trainer.cfg.train, steps=s + n))
    trainer.report.open(MetricsLogger(trainer.output_dir, s + n, rank0, False, False, start_step=s), None)
    trainer.train()


def describe(trainer: Trainer) -> dict:
    """Sizes of the trainer's state (a function: no reference to a parameter outlives it)."""
    params = list(trainer.model.parameters())
    p_loc = local_bytes(params)
    t_loc = local_bytes(trainer.params)
    opt_loc = local_bytes([v for st in trainer.optimizer.state.values() for v in st.values()
                           if isinstance(v, torch.Tensor) and v.ndim > 0])
    return {"n_params": sum(p.numel() for p in params), "n_train": sum(p.numel() for p in trainer.params),
            "per_rank": gather([float(p_loc), float(t_loc), float(opt_loc)]),
            "tokens_per_step": trainer.loader.global_batch * trainer.cfg.data.seq_len,
            "data": dict(trainer.data_meta)}


def teardown(trainer: Trainer) -> None:
    trainer.preemption.uninstall()
    trainer.checkpointer.close()
    trainer.release_locks()  # the next Trainer takes the same train.output_dir


def measure_training(args, cfgs: dict, rank0: bool, log) -> tuple[dict, dict]:
    """(per variant: its builds' measurements, per variant: its state's sizes); builds alternate."""
    # Untimed, unmeasured: one throwaway build + 1 step, so that one-time costs of the process (library
    # code paged in on first use, allocator arenas, ...) are not charged to whichever variant runs first.
    settle()
    dist.barrier()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(log):
        trainer = Trainer(cfgs["lora"])
        train_call(trainer, 1, rank0)
        teardown(trainer)
    del trainer
    settle()
    say(f"  warm-up build + 1 LoRA step (not measured): {time.perf_counter() - t0:.1f} s")

    train_res: dict[str, list] = {"lora": [], "full": []}
    info: dict[str, dict] = {}
    for r in range(args.repeats):
        for which in (("lora", "full") if r % 2 == 0 else ("full", "lora")):
            row, facts, after = train_once(args, cfgs[which], rank0, log, which not in info)
            if facts is not None:
                info[which] = facts
            train_res[which].append(row)
            tps, wall, build_s, mem = row
            say(f"  [{r + 1}/{args.repeats}] train {which}: {tps:7.1f} tok/s ({wall / args.steps:.2f} s/step; "
                f"build {build_s:.1f} s), peak RSS + per rank " + ", ".join(f"{x[0] / MiB:.0f}" for x in mem)
                + " MiB (VmHWM + " + ", ".join(f"{x[5] / MiB:.0f}" for x in mem) + ", base "
                + ", ".join(f"{x[3] / MiB:.0f}" for x in mem) + "); RSS after teardown - before build: " + ", ".join(
                    f"{(a[0] - x[3]) / MiB:+.0f}" for a, x in zip(after, mem)) + " MiB")
    return train_res, info


def train_once(args, cfg, rank0: bool, log, want_facts: bool) -> tuple[tuple, dict | None, list]:
    """One fresh Trainer: W untimed steps, N timed ones. ((tok/s, wall s, build s, per-rank memory), its state's
    sizes when `want_facts`, every rank's RSS after the teardown)."""
    settle()
    dist.barrier()
    with PeakRSS() as m, contextlib.redirect_stdout(log):
        t0 = time.perf_counter()
        trainer = Trainer(cfg)
        build_s = time.perf_counter() - t0
        built = statm()[0]
        train_call(trainer, args.warmup, rank0)
        dist.barrier()
        t0 = time.perf_counter()
        train_call(trainer, args.steps, rank0)
        wall = time.perf_counter() - t0
    wall, build_s = max_over_ranks(wall), max_over_ranks(build_s)
    tokens = args.steps * trainer.loader.global_batch * cfg.data.seq_len
    mem = gather([m.peak - m.base, float(m.peak), built - m.base, float(m.base), m.peak_anon - m.base_anon,
                  m.hwm_added])
    facts = describe(trainer) if want_facts else None
    teardown(trainer)
    del trainer
    settle()
    after = gather([float(statm()[0])])
    return (tokens / wall, wall, build_s, mem), facts, after


# -- report ----------------------------------------------------------------------------------------------

W = 30  # the label column


@dataclasses.dataclass
class Results:
    """Everything the report prints, with the medians over builds it takes of them."""

    args: argparse.Namespace
    world: int
    n_files: int
    disk_bytes: int
    t_start: float
    loads: Loads
    train: dict  # "lora" | "full" -> per build: (tok/s, wall s, build s, per-rank memory)
    info: dict  # "lora" | "full" -> describe()

    @property
    def ranks(self) -> range:
        return range(self.world)

    def tr(self, which: str, i: int, rk: int | None = None) -> float:
        """Median over builds of measurement i of rank rk (None: the highest of the ranks), MiB."""
        return statistics.median(max(x[3][k][i] for k in (self.ranks if rk is None else [rk]))
                                 for x in self.train[which]) / MiB

    def ld(self, which: str, i: int, rk: int | None = None) -> float:
        return statistics.median(max(x[1][k][i] for k in (self.ranks if rk is None else [rk]))
                                 for x in self.loads.res[which]) / MiB

    def tps(self, which: str) -> float:
        return statistics.median(x[0] for x in self.train[which])

    def load_s(self, which: str) -> float:
        return statistics.median(x[0] for x in self.loads.res[which])


def header_lines(res: Results) -> list[str]:
    """The setup: machine, model, data, variants, how RSS is read."""
    import transformers

    args, world, lo = res.args, res.world, res.loads
    il, ifu = res.info["lora"], res.info["full"]
    n_params, data = ifu["n_params"], ifu["data"]
    return [
        f"shardlm LoRA benchmark: {world} ranks, gloo on cpu ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores), {torch.get_num_threads()} thread/rank, torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
        f"model: HF Llama (LlamaForCausalLM, random init), hidden 1024, {args.layers} layers, 8 heads / 4 KV heads, "
        f"intermediate 2816, vocab 8192, untied head: {n_params / 1e6:.2f}M params, fp32 = {lo.full_b / MiB:.0f} MiB "
        f"({res.n_files} safetensors files, {res.disk_bytes / MiB:.0f} MiB on disk); rank shards "
        f"{', '.join(f'{b / MiB:.0f}' for b in lo.shards)} MiB",
        f"training: Trainer, model.init_from=hf:<dir>, data.format=sft ({data.get('samples')} samples of "
        f"demo_assets.sft_pairs, packed into {data.get('sequences')} rows, {100 * data.get('fill', float('nan')):.0f}% "
        f"non-padding), seq_len 128 x micro_batch 2 x dp {world} = {ifu['tokens_per_step']} tokens/step "
        "(padding included), fp32, FSDP2, AdamW, no checkpoints",
        f"  LoRA: rank {LORA_RANK}, alpha {LORA_ALPHA}, {TARGETS}: {il['n_train'] / 1e6:.3f}M trainable "
        f"({100 * il['n_train'] / il['n_params']:.2f}%; embeddings, norms, head frozen); full: all "
        f"{ifu['n_train'] / 1e6:.2f}M trainable",
        f"  each variant built {args.repeats} times, fresh Trainer each time, order alternating (after one unmeasured "
        f"warm-up build); per build {args.warmup} warmup steps, then {args.steps} timed steps as one train() call "
        "from a barrier (slowest rank); medians over builds",
        "RSS (MiB): sampled every 5 ms from a thread (/proc/self/statm). Training window: from just before "
        "Trainer(cfg) to the end of the timed steps. peak+ = peak - RSS before Trainer(cfg) (after gc + "
        "malloc_trim); peak = absolute; HWM+ = the kernel's peak (VmHWM, reset at the start) - the same baseline, "
        "which no sampling can miss; anon+ = peak+ of anonymous memory only; built+ = RSS once Trainer(cfg) "
        "returned (model loaded, data tokenised) - before. 'max' = the highest rank.",
        "",
    ]


def training_lines(res: Results) -> list[str]:
    """Table 1: LoRA vs full fine-tuning, the state each holds, every build."""
    ranks, tr, steps = res.ranks, res.tr, res.args.steps
    state = {w: [[v / MiB for v in row] for row in res.info[w]["per_rank"]] for w in res.info}
    lines = [
        "1. LoRA vs full fine-tuning",
        f"  {'':<{W}} {'tok/s':>7} {'s/step':>7} {'build s':>7} {'peak+ max':>9} "
        + " ".join(f"{f'r{rk} peak+':>8}" for rk in ranks) + " "
        + " ".join(f"{f'r{rk} peak':>8}" for rk in ranks) + f" {'HWM+ max':>8} {'anon+ max':>9} {'built+ max':>10}",
    ]
    for w, label in (("lora", f"LoRA r={LORA_RANK}, 7 projections"), ("full", "full fine-tuning")):
        step_s = statistics.median(x[1] for x in res.train[w]) / steps
        build = statistics.median(x[2] for x in res.train[w])
        lines.append(f"  {label:<{W}} {res.tps(w):>7.1f} {step_s:>7.2f} {build:>7.1f} {tr(w, 0):>9.0f} "
                     + " ".join(f"{tr(w, 0, rk):>8.0f}" for rk in ranks) + " "
                     + " ".join(f"{tr(w, 1, rk):>8.0f}" for rk in ranks)
                     + f" {tr(w, 5):>8.0f} {tr(w, 4):>9.0f} {tr(w, 2):>10.0f}")
    return lines + [
        "  state held per rank after the steps (MiB; r0 / r1): " + "; ".join(
            f"{w}: params " + " / ".join(f"{x[0]:.0f}" for x in state[w]) + ", of them trainable "
            + " / ".join(f"{x[1]:.1f}" for x in state[w]) + ", AdamW moments "
            + " / ".join(f"{x[2]:.1f}" for x in state[w]) for w in ("lora", "full"))
        + " (+ during each step: grads of the trainable shard, all-gathered blocks, activations)",
        "  per build, in run order: " + "; ".join(
            f"{w} " + ", ".join(f"{x[0]:.1f} tok/s / +{max(m[0] for m in x[3]) / MiB:.0f} MiB" for x in res.train[w])
            for w in ("lora", "full")),
        "",
    ]


def load_lines(res: Results) -> list[str]:
    """Table 2: the two HF loads, the first build's breakdown, the logits check."""
    ranks, ld, lo = res.ranks, res.ld, res.loads
    parts = lo.parts
    lines = [
        f"2. HF load into one process per rank, both ranks at once, {res.args.repeats} times each alternating; "
        "medians; time = slowest rank",
        "  shardlm = shardlm.build.build_model (meta -> fully_shard -> to_empty -> init_weights -> load_hf_weights: "
        "each rank reads only its rows); HF = AutoModelForCausalLM.from_pretrained(dir, dtype=float32) on EVERY "
        "rank (whole model each)",
        "  then every parameter is read once ('touch', untimed in 'load s'): from_pretrained's parameters are lazy "
        "copy-on-write mmaps of the safetensors (pages resident only once read, file-backed, not anon)",
        f"  {'':<{W}} {'load s':>7} {'touch s':>7} {'peak+ max':>9} "
        + " ".join(f"{f'r{rk} peak+':>8}" for rk in ranks) + f" {'anon+ max':>9} {'at return':>9} "
        f"{'touched':>8} {'anon kept':>9}",
    ]
    for w, label in (("shardlm", "shardlm build_model (sharded)"), ("hf", "from_pretrained (full, lazy)")):
        touch_s = statistics.median(x[2] for x in lo.res[w])
        lines.append(f"  {label:<{W}} {res.load_s(w):>7.2f} {touch_s:>7.2f} {ld(w, 0):>9.0f} "
                     + " ".join(f"{ld(w, 0, rk):>8.0f}" for rk in ranks)
                     + f" {ld(w, 1):>9.0f} {ld(w, 4):>9.0f} {ld(w, 2):>8.0f} {ld(w, 3):>9.0f}")
    return lines + [
        f"  reference: full model {lo.full_b / MiB:.0f} MiB; rank shards "
        + ", ".join(f"r{rk} {lo.shards[rk] / MiB:.0f}" for rk in ranks) + " MiB",
        "  peak+ = peak RSS - RSS before the call (load + touch); anon+ = the same for anonymous memory only "
        "(leaves out page-cache pages of mmapped files); at return = RSS + when the load returned; touched = "
        "RSS + after the touch; anon kept = anonymous memory + after the touch (what the rank owns); max = highest rank",
        f"  rank-0 build_model breakdown (first call, untimed): {parts['build_model']:.2f} s, of which "
        f"init_weights {parts['init_weights']:.2f} s (random init of every parameter, then overwritten), "
        f"load_hf_weights {parts['load_hf_weights']:.2f} s",
        f"  check: logits of the shardlm-loaded (sharded) model vs the from_pretrained one on 2x32 random tokens: "
        f"max |diff| {lo.diff:.2e} (max |logit| {lo.scale:.2f})",
        "",
    ]


def summary_lines(res: Results) -> list[str]:
    """The two findings in one line each, and the total time."""
    tr, ld, ranks, lo = res.tr, res.ld, res.ranks, res.loads
    tps = {w: res.tps(w) for w in ("lora", "full")}
    return [
        f"LoRA vs full FT: {tps['lora']:.1f} vs {tps['full']:.1f} tokens/s ({tps['lora'] / tps['full']:.2f}x); "
        f"peak RSS added (highest rank) {tr('lora', 0):.0f} vs {tr('full', 0):.0f} MiB "
        f"({tr('full', 0) - tr('lora', 0):.0f} MiB less, {tr('lora', 0) / tr('full', 0):.2f}x), absolute peak "
        f"{max(tr('lora', 1, rk) for rk in ranks):.0f} vs {max(tr('full', 1, rk) for rk in ranks):.0f} MiB",
        f"HF load: shardlm sharded {res.load_s('shardlm'):.2f} s, peak RSS added {ld('shardlm', 0):.0f} MiB (anon "
        f"{ld('shardlm', 1):.0f}, keeps {ld('shardlm', 3):.0f}) per rank; from_pretrained {res.load_s('hf'):.2f} s "
        f"(lazy), {ld('hf', 0):.0f} MiB once read (anon {ld('hf', 1):.0f}, all file-backed) per rank; full model "
        f"{lo.full_b / MiB:.0f} MiB, rank shard {max(lo.shards) / MiB:.0f} MiB",
        f"total benchmark time {time.perf_counter() - res.t_start:.0f} s",
    ]


if __name__ == "__main__":
    main()
