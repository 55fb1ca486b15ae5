"""LoRA vs full fine-tuning of an HF model, and shardlm's sharded HF load vs `from_pretrained`.

    torchrun --standalone --nproc_per_node 2 benchmarks/lora.py [--repeats R] [--steps N] [--save]

One run, 2 gloo ranks on CPU (one thread per rank). Rank 0 first writes, to a temp dir under /tmp, an HF
Llama (transformers LlamaConfig: hidden 1024, --layers blocks (default 8), 8 heads, 4 KV heads,
intermediate 2816, vocab 8192, untied head; random init, fp32) with `save_pretrained(max_shard_size="100MB")`,
the tokenizer of `shardlm.demo_assets.make_tokenizer` (byte-level BPE, chat template) and an SFT .jsonl of
`demo_assets.sft_pairs` (stdlib signature -> docstring line); the other rank waits at a barrier.

1. Training, LoRA vs full fine-tuning of that model: a `Trainer` (model.init_from=hf:<dir>, so every rank
   reads only its shards of the safetensors; data.format=sft, seq_len 128, micro batch 2, grad_accum 1, fp32,
   FSDP2 over both ranks, AdamW; no checkpointing, progress bar off) with
     LoRA  lora.rank=16, alpha=32, all 7 projections (q,k,v,o,gate,up,down): only the adapters train
           (embeddings, norms and head frozen), so AdamW holds moments for the adapters only;
     full  lora.rank=0: every parameter trains (grads + 2 AdamW moments for all of them).
   Each variant is built fresh (and thrown away) R times, order alternating (L,F / F,L / ...): per build,
   --warmup untimed steps (the first allocates the optimizer state), then N timed steps as one
   `Trainer.train()` call started from a barrier, its time the slowest rank's; tokens/s = N x global batch
   x seq_len / that time. RSS is sampled (every 5 ms, from a thread, /proc/self/statm) from just before
   `Trainer(cfg)` to the end of the timed steps: "peak +" is the peak minus the RSS before the Trainer was
   built (after gc.collect + malloc_trim), "peak" the absolute peak, "built +" the RSS right after the
   Trainer was built (model loaded, data tokenised) minus the same baseline. Medians over the R builds.
2. HF load, same process, both ranks at once, R times alternating, medians:
     shardlm  `shardlm.trainer.build_model` (what the Trainer runs: Transformer on meta -> fully_shard each
              block + root -> to_empty -> init_weights -> `hf_io.load_hf_weights`: every rank reads only its
              own rows of each tensor from the memory-mapped safetensors),
     HF       `transformers.AutoModelForCausalLM.from_pretrained(dir, dtype=float32)` of the same files,
              on EVERY rank (each rank builds the whole model, as a non-sharded loader does).
   Time: the slowest rank's, from a barrier. RSS: peak minus the RSS just before (anon = resident minus
   file-backed/shared pages, i.e. not counting page-cache pages of the mmapped files), and what is still
   resident when the call returns (the loaded model). Compared with the model's full size and the rank's
   shard (its local parameter bytes). The files were just written, so both read from the page cache.
   Once (untimed) the two loaded models' logits are compared on the same tokens.

The temp dir (model, data, run output, token caches) is deleted at exit.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardlm.config import load_config
from shardlm.metrics import MetricsLogger
from shardlm.parallel.mesh import ParallelDims
from shardlm.trainer import Trainer, build_model, build_model_config

ROOT = Path(__file__).resolve().parents[1]
RESULT = Path(__file__).resolve().parent / "results" / "lora_cpu.txt"
MiB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")
LORA_RANK, LORA_ALPHA = 16, 32
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
SFT_PAIRS = 600  # ~150 packed rows of 128: more than the run consumes (and it wraps around anyway)


# -- assets ----------------------------------------------------------------------------------------

def make_hf_model(out: Path, n_layers: int) -> None:
    """The HF Llama, sharded safetensors (fp32), + demo tokenizer (vocab 512 < the model's 8192)."""
    import transformers

    from shardlm.demo_assets import make_tokenizer

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


def shared_tmpdir(n_layers: int) -> Path:
    """Rank 0 makes the temp dir, the HF model and the SFT data; every rank gets the path after that."""
    from shardlm.demo_assets import sft_pairs

    obj = [None]
    if dist.get_rank() == 0:
        d = Path(tempfile.mkdtemp(prefix="shardlm-lora-bench-", dir="/tmp"))
        try:
            make_hf_model(d / "model", n_layers)
            (d / "sft.jsonl").write_text("".join(json.dumps(p) + "\n" for p in sft_pairs(SFT_PAIRS)))
            obj[0] = str(d)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            dist.broadcast_object_list([None], src=0)
            raise
    dist.broadcast_object_list(obj, src=0)
    if obj[0] is None:
        raise RuntimeError("rank 0 failed to write the benchmark model")
    return Path(obj[0])


# -- memory ----------------------------------------------------------------------------------------

try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc
    _LIBC = None


def settle() -> None:
    """Free what Python and glibc hold on to, so the baseline RSS is what is live."""
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def statm() -> tuple[int, int]:
    """(resident, anonymous = resident - shared/file-backed) bytes of this process."""
    with open("/proc/self/statm") as f:
        v = f.read().split()
    return int(v[1]) * PAGE, (int(v[1]) - int(v[2])) * PAGE


class PeakRSS:
    """Samples this process's RSS every `period` s from a thread; peak and peak anon since entry."""

    def __init__(self, period: float = 0.005):
        self.period = period

    def __enter__(self):
        self.base, self.base_anon = statm()
        self.peak, self.peak_anon = self.base, self.base_anon
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _update(self, res: int, anon: int) -> None:
        self.peak = max(self.peak, res)
        self.peak_anon = max(self.peak_anon, anon)

    def _run(self) -> None:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        try:
            while not self._stop.is_set():
                v = os.pread(fd, 128, 0).split()
                self._update(int(v[1]) * PAGE, (int(v[1]) - int(v[2])) * PAGE)
                time.sleep(self.period)
        finally:
            os.close(fd)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._update(*statm())
        return False


def gather(values: list[float]) -> list[list[float]]:
    """Every rank's `values` -> [rank][i]."""
    out = [torch.zeros(len(values), dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor(values, dtype=torch.float64))
    return [t.tolist() for t in out]


def max_over_ranks(x: float) -> float:
    t = torch.tensor(x, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def local_bytes(tensors) -> tuple[int, int]:
    """(this rank's local bytes, full bytes) of tensors (DTensors: their local shard)."""
    loc = full = 0
    for t in tensors:
        lt = t.to_local() if isinstance(t, DTensor) else t
        loc += lt.numel() * lt.element_size()
        full += t.numel() * t.element_size()
    return loc, full


# -- benchmark -------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="builds of each variant, order alternating (default 2)")
    ap.add_argument("--steps", type=int, default=10, help="timed training steps per build (default 10)")
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

    def say(msg: str) -> None:
        if rank0:
            print(msg, flush=True)

    say(f"writing the HF model ({args.layers} layers) and SFT data ...")
    tmp = shared_tmpdir(args.layers)
    try:
        run(args, tmp, rank, world, say, t_start)
    finally:
        dist.barrier()
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.destroy_process_group()


def run(args, tmp: Path, rank: int, world: int, say, t_start: float) -> None:
    rank0 = rank == 0
    model_dir = tmp / "model"
    log = open(tmp / f"trainer-rank{rank}.log", "w")
    st_files = sorted(model_dir.glob("*.safetensors"))
    disk_bytes = sum(p.stat().st_size for p in st_files)
    say(f"  {len(st_files)} safetensors files, {disk_bytes / MiB:.0f} MiB ({time.perf_counter() - t_start:.0f} s)")

    common = [
        f"--model.init_from=hf:{model_dir}", "--data.format=sft", f"--data.path={tmp / 'sft.jsonl'}",
        f"--data.cache_dir={tmp / 'cache'}", "--data.seq_len=128", "--train.micro_batch_size=2",
        "--train.grad_accum=1", "--train.mixed_precision=fp32", "--train.device=cpu", "--train.steps=100000",
        "--train.warmup_steps=2", "--train.lr=1e-4", f"--train.output_dir={tmp / 'run'}",
        "--metrics.progress_bar=false", "--metrics.log_every=100000",
        "--checkpoint.save_final=false", "--checkpoint.resume=none", "--checkpoint.interval=0",
        f"--checkpoint.dir={tmp / 'ckpt'}",
    ]
    cfgs = {
        "lora": load_config(None, [*common, f"--lora.rank={LORA_RANK}", f"--lora.alpha={LORA_ALPHA}",
                                   f"--lora.targets={TARGETS}"]),
        "full": load_config(None, [*common, "--lora.rank=0"]),
    }

    # -- 2 (run first: cheap). HF load: shardlm's sharded build_model vs from_pretrained ---------------
    import transformers

    full_cfg = cfgs["full"]
    with contextlib.redirect_stdout(log):
        from shardlm.data import load_tokenizer
        from shardlm.trainer import tokenizer_spec

        tok = load_tokenizer(tokenizer_spec(full_cfg))
    mc = build_model_config(full_cfg, tok.vocab_size)
    mesh = ParallelDims(1, -1, world).build_mesh("cpu")
    device = torch.device("cpu")
    shard_b = full_b = 0

    def load_shardlm():
        return build_model(mc, mesh, full_cfg, device)

    def load_hf():
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    # Untimed: the two loads agree (same logits on the same tokens).
    ours, theirs = load_shardlm(), load_hf()
    shard_b, full_b = local_bytes(list(ours.parameters()))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tok.vocab_size, (2, 32), generator=g)
    with torch.no_grad():
        diff = (ours(ids) - theirs(ids).logits).abs().max().item()
        scale = theirs(ids).logits.abs().max().item()
    diff = max_over_ranks(diff)
    del ours, theirs
    shards = [int(x[0]) for x in gather([float(shard_b)])]
    say(f"  logits check: shardlm-loaded vs from_pretrained max |diff| {diff:.2e} (max |logit| {scale:.2f})")

    load_res: dict[str, list] = {"shardlm": [], "hf": []}
    for r in range(args.repeats):
        for which in (("shardlm", "hf") if r % 2 == 0 else ("hf", "shardlm")):
            settle()
            dist.barrier()
            with PeakRSS() as m:
                t0 = time.perf_counter()
                model = load_shardlm() if which == "shardlm" else load_hf()
                wall = time.perf_counter() - t0
                kept, kept_anon = statm()
            wall = max_over_ranks(wall)
            mem = gather([m.peak - m.base, m.peak_anon - m.base_anon, kept - m.base, kept_anon - m.base_anon,
                          float(m.peak)])
            del model
            settle()
            load_res[which].append((wall, mem))
            say(f"  [{r + 1}/{args.repeats}] load {which:>7}: {wall:6.2f} s, RSS + per rank "
                + ", ".join(f"{x[0] / MiB:.0f}" for x in mem) + " MiB (anon + "
                + ", ".join(f"{x[1] / MiB:.0f}" for x in mem) + ")")
    del mesh

    # -- 1. training: LoRA vs full fine-tuning ----------------------------------------------------------
    def train_call(trainer: Trainer, n: int) -> None:
        """One Trainer.train() call of n more steps (train.steps raised, a fresh MetricsLogger)."""
        s = trainer.step
        trainer.cfg = dataclasses.replace(trainer.cfg, train=dataclasses.replace(trainer.cfg.train, steps=s + n))
        trainer.metrics = MetricsLogger(trainer.output_dir, s + n, rank0, False, False, start_step=s)
        trainer.train()

    train_res: dict[str, list] = {"lora": [], "full": []}
    info: dict[str, dict] = {}
    for r in range(args.repeats):
        for which in (("lora", "full") if r % 2 == 0 else ("full", "lora")):
            cfg = cfgs[which]
            settle()
            dist.barrier()
            with PeakRSS() as m, contextlib.redirect_stdout(log):
                t0 = time.perf_counter()
                trainer = Trainer(cfg)
                build_s = time.perf_counter() - t0
                built = statm()[0]
                train_call(trainer, args.warmup)
                dist.barrier()
                t0 = time.perf_counter()
                train_call(trainer, args.steps)
                wall = time.perf_counter() - t0
            wall, build_s = max_over_ranks(wall), max_over_ranks(build_s)
            tokens = args.steps * trainer.loader.global_batch * cfg.data.seq_len
            mem = gather([m.peak - m.base, float(m.peak), built - m.base, float(m.base)])
            if which not in info:
                params = list(trainer.model.parameters())
                p_loc, p_full = local_bytes(params)
                t_loc, t_full = local_bytes(trainer.params)
                opt_loc, _ = local_bytes([v for s in trainer.optimizer.state.values() for v in s.values()
                                          if isinstance(v, torch.Tensor) and v.ndim > 0])
                info[which] = {"n_params": sum(p.numel() for p in params),
                               "n_train": sum(p.numel() for p in trainer.params),
                               "per_rank": gather([float(p_loc), float(t_loc), float(opt_loc)]),
                               "tokens_per_step": trainer.loader.global_batch * cfg.data.seq_len,
                               "global_batch": trainer.loader.global_batch}
            trainer.preemption.uninstall()
            trainer.checkpointer.close()
            del trainer
            settle()
            after = gather([float(statm()[0])])
            train_res[which].append((tokens / wall, wall, build_s, mem))
            say(f"  [{r + 1}/{args.repeats}] train {which}: {tokens / wall:7.1f} tok/s ({wall / args.steps:.2f} s/step; "
                f"build {build_s:.1f} s), peak RSS + per rank " + ", ".join(f"{x[0] / MiB:.0f}" for x in mem)
                + " MiB; RSS after teardown - before build: " + ", ".join(
                    f"{(a[0] - x[3]) / MiB:+.0f}" for a, x in zip(after, mem)) + " MiB")

    log.close()
    if not rank0:
        return

    # -- report ------------------------------------------------------------------------------------------
    med = statistics.median
    mm = lambda vals: med(vals) / MiB  # noqa: E731
    ranks = range(world)

    def tr(which: str, i: int, rk: int) -> float:
        return mm([x[3][rk][i] for x in train_res[which]])

    def ld(which: str, i: int, rk: int) -> float:
        return mm([x[1][rk][i] for x in load_res[which]])

    tps = {w: med(x[0] for x in train_res[w]) for w in train_res}
    step_s = {w: med(x[1] for x in train_res[w]) / args.steps for w in train_res}
    build = {w: med(x[2] for x in train_res[w]) for w in train_res}
    peak_add = {w: max(tr(w, 0, rk) for rk in ranks) for w in train_res}
    load_t = {w: med(x[0] for x in load_res[w]) for w in load_res}
    il, ifu = info["lora"], info["full"]
    n_params = ifu["n_params"]
    lines = [
        f"shardlm LoRA benchmark: {world} ranks, gloo on cpu ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores), {torch.get_num_threads()} thread/rank, torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
        f"model: HF Llama, hidden 1024, {args.layers} layers, 8 heads / 4 KV heads, intermediate 2816, vocab 8192, "
        f"untied head: {n_params / 1e6:.2f}M params, fp32, {full_b / MiB:.0f} MiB "
        f"({len(st_files)} safetensors files, {disk_bytes / MiB:.0f} MiB on disk); rank shards "
        f"{', '.join(f'{b / MiB:.0f}' for b in shards)} MiB",
        f"training: Trainer, model.init_from=hf:<dir>, data.format=sft (demo_assets.sft_pairs, packed), seq_len 128 "
        f"x micro_batch 2 x dp {world} = {ifu['tokens_per_step']} tokens/step, fp32, FSDP2, AdamW, no checkpoints; "
        f"each build: {args.warmup} warmup + {args.steps} timed steps (one train() call, slowest rank); "
        f"{args.repeats} builds per variant, order alternating; medians",
        f"  LoRA: rank {LORA_RANK}, alpha {LORA_ALPHA}, targets {TARGETS}: {il['n_train'] / 1e6:.3f}M trainable "
        f"({100 * il['n_train'] / il['n_params']:.2f}%); full: all {ifu['n_train'] / 1e6:.2f}M trainable",
        "RSS: sampled every 5 ms from a thread (/proc/self/statm), MiB. Training: from just before Trainer(cfg) to "
        "the end of the timed steps; peak+ = peak - RSS before the build, built+ = RSS after the build - the same.",
        "",
        "1. LoRA vs full fine-tuning",
        f"  {'':<26} {'tok/s':>8} {'s/step':>7} {'build s':>8} {'peak+ max':>10} "
        + " ".join(f"{f'r{rk} peak+':>9}" for rk in ranks) + " "
        + " ".join(f"{f'r{rk} peak':>8}" for rk in ranks) + " "
        + " ".join(f"{f'r{rk} built+':>9}" for rk in ranks),
    ]
    for w, label in (("lora", f"LoRA r={LORA_RANK}, 7 projections"), ("full", "full fine-tuning")):
        lines.append(f"  {label:<26} {tps[w]:>8.1f} {step_s[w]:>7.2f} {build[w]:>8.1f} {peak_add[w]:>10.0f} "
                     + " ".join(f"{tr(w, 0, rk):>9.0f}" for rk in ranks) + " "
                     + " ".join(f"{tr(w, 1, rk):>8.0f}" for rk in ranks) + " "
                     + " ".join(f"{tr(w, 2, rk):>9.0f}" for rk in ranks))
    lines += [
        "  per rank state (MiB), rank 0: " + "; ".join(
            f"{w}: params {info[w]['per_rank'][0][0] / MiB:.0f} (trainable {info[w]['per_rank'][0][1] / MiB:.1f}), "
            f"AdamW moments {info[w]['per_rank'][0][2] / MiB:.1f}" for w in ("lora", "full"))
        + "; full FT also holds grads the size of the trainable shard during the step",
        "  per build: " + "; ".join(f"{w} " + ", ".join(f"{x[0]:.1f} tok/s" for x in train_res[w])
                                    for w in ("lora", "full")),
        "",
        f"2. HF load, {args.repeats} times each, alternating, both ranks at once (from_pretrained: every rank loads "
        "the whole model); time = slowest rank",
        f"  {'':<36} {'time s':>7} "
        + " ".join(f"{f'r{rk} peak+':>9} {f'r{rk} anon+':>9} {f'r{rk} kept+':>9}" for rk in ranks),
    ]
    for w, label in (("shardlm", "shardlm build_model (sharded load)"),
                     ("hf", "AutoModelForCausalLM.from_pretrained")):
        lines.append(f"  {label:<36} {load_t[w]:>7.2f} "
                     + " ".join(f"{ld(w, 0, rk):>9.0f} {ld(w, 1, rk):>9.0f} {ld(w, 2, rk):>9.0f}" for rk in ranks))
    lines += [
        f"  reference: full model {full_b / MiB:.0f} MiB; rank shards "
        + ", ".join(f"r{rk} {shards[rk] / MiB:.0f}" for rk in ranks) + " MiB",
        "  peak+ = peak RSS - RSS before the call; anon+ = the same without file-backed pages (the mmapped "
        "safetensors); kept+ = RSS when the call returns - before",
        f"  logits, shardlm-loaded vs from_pretrained on 2x32 random tokens: max |diff| {diff:.2e} "
        f"(max |logit| {scale:.2f})",
        "",
        f"LoRA vs full FT: {tps['lora']:.1f} vs {tps['full']:.1f} tokens/s ({tps['lora'] / tps['full']:.2f}x), "
        f"peak RSS added (max over ranks) {peak_add['lora']:.0f} vs {peak_add['full']:.0f} MiB "
        f"({peak_add['full'] - peak_add['lora']:.0f} MiB less, {peak_add['lora'] / peak_add['full']:.2f}x)",
        f"HF load: shardlm sharded {load_t['shardlm']:.2f} s, peak RSS added (max over ranks) "
        f"{max(ld('shardlm', 0, rk) for rk in ranks):.0f} MiB; from_pretrained {load_t['hf']:.2f} s, "
        f"{max(ld('hf', 0, rk) for rk in ranks):.0f} MiB (full model {full_b / MiB:.0f} MiB, "
        f"rank shard {max(shards) / MiB:.0f} MiB)",
        f"total benchmark time {time.perf_counter() - t_start:.0f} s",
    ]
    text = "\n".join(lines) + "\n"
    print("\n" + text, end="", flush=True)
    if args.save:
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(text)
        print(f"saved to {RESULT.relative_to(ROOT)}", flush=True)


if __name__ == "__main__":
    main()
