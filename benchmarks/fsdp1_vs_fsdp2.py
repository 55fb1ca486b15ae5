"""FSDP1 (FullyShardedDataParallel, flat params) vs FSDP2 as shardlm uses it (fully_shard, DTensor params).

    torchrun --standalone --nproc_per_node 2 benchmarks/fsdp1_vs_fsdp2.py [--repeats R] [--steps N] [--save]

One run, 2 gloo ranks on CPU (one thread per rank), the same model shape for both: the debug preset with
model.dim=768 n_layers=6 ffn_dim=2048 n_heads=12 n_kv_heads=4 vocab_size=8192 and head_dim = 768 / 12 = 64
(set explicitly: shardlm's build_model_config would keep the debug preset's 32), 50.3M parameters, fp32,
seq_len 64, micro batch 1 per rank, on the same batches (random token ids from a generator seeded per rank
and step; rank r's batch k is the same for both), with the same initial weights (both built on `meta`, then
`Transformer.init_weights(seed=0)`, whose values depend only on the seed and the parameter name).

  FSDP1  `Transformer` on meta -> `to_empty(cpu)` + `init_weights` (the full model on every rank: FSDP1
         flattens materialised modules) -> `FullyShardedDataParallel(auto_wrap_policy=ModuleWrapPolicy({Block}),
         use_orig_params=True, device_id=cpu)` (FULL_SHARD: every block a flat-param unit, the root holds
         embeddings, final norm and head). AdamW with shardlm's groups (decay on matrices: decided by name
         from the unwrapped shapes, because use_orig_params exposes 1-D shard views), `model.clip_grad_norm_`.
         Checkpoint: full state dict, `FSDP.state_dict_type(FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=
         False, rank0_only=True), FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True))` (why not
         offload_to_cpu=True: see OFFLOAD below), `model.state_dict()` + `FSDP.optim_state_dict`, rank 0
         `torch.save`s {model, optim, step} to one file, flush + fsync, barrier.
  FSDP2  `shardlm.build.build_model` (meta -> fully_shard per block, then the root -> to_empty -> init_weights
         of each rank's shards), `shardlm.optim.build_optimizer`, `shardlm.parallel.fsdp.clip_grad_norm_`.
         Checkpoint: `shardlm.checkpoint.Checkpointer.save(blocking=True)` (DCP, one file per rank, fsynced,
         atomic rename by rank 0).

A training step, for both: forward, mean cross-entropy, backward, clip the global grad norm to 1.0, AdamW
step (shardlm's defaults: lr 3e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1; no LR schedule),
zero_grad(set_to_none=True). Each repeat builds each variant afresh (order alternating per repeat): 2
warmup steps, N timed steps (step time = the slowest rank's, per step; median), then one checkpoint save.

Step time is also split into forward + backward, clip_grad_norm_, and AdamW step + zero_grad (each the slowest
rank's, median).

Memory: a background thread (`PeakRSS`, benchmarks/_common.py) reads /proc/self/statm every 5 ms; alongside,
the kernel's peak (VmHWM, reset via /proc/self/clear_refs). Before each measured phase: gc.collect() +
malloc_trim(0), so the baseline is what is live. By default (--malloc mmap) the script first calls
mallopt(M_MMAP_THRESHOLD, 256 KiB): every tensor of 256 KiB or more is then its own mapping, unmapped when
freed, so RSS tracks what PyTorch holds; with glibc's default dynamic threshold freed tensors stay in the heap
and the training peaks come out about twice as large, mostly glibc's cache (--malloc default shows that).
Figures (MiB, per rank):
  build     peak RSS while building + wrapping the model, over the RSS before the build
  training  peak RSS during the training steps (warmup + timed; the first step creates AdamW's state),
            over the same pre-build baseline: sharded params + grads + AdamW state + unsharded params and
            activations in flight + whatever the allocator holds on to
  save      peak RSS during the checkpoint save, over the RSS just before it

LoRA-style partial freezing: `shardlm.lora.apply_lora(rank 8, alpha 16, every linear of every block)` on the
meta model before wrapping (for FSDP2 through build_model with lora.rank=8): only lora_A/lora_B train, each
block unit mixes frozen and trainable params, the root unit is all frozen. Tried: FSDP1 with
use_orig_params=False (flat params must share requires_grad), FSDP1 with use_orig_params=True, FSDP2. Where it
runs: 1 warmup + --lora-steps timed steps; gradient bytes held on the rank right after backward (FSDP1: the
units' FlatParameter.grad; FSDP2: the trainable DTensors' local grads) vs the rank's trainable-param bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
import shutil
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    LIBC,
    ROOT,
    MiB,
    PeakRSS,
    clear,
    du,
    gather,
    local_bytes,
    report,
    rss,
    say,
    settle,
    shared_tmpdir,
    slowest,
    state_tensors,
)
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from shardlm.checkpoint import Checkpointer
from shardlm.config import load_config
from shardlm.distributed.env import shutdown_distributed
from shardlm.lora import apply_lora
from shardlm.models import Transformer
from shardlm.models.llama import Block
from shardlm.parallel.dims import ParallelDims
from shardlm.parallel.fsdp import clip_grad_norm_
from shardlm.train.optim import build_optimizer
from shardlm.build import STORED_FORMS, build_model, build_model_config

RESULT = Path(__file__).resolve().parent / "results" / "fsdp1_vs_fsdp2_cpu.txt"
MODEL = ["--model.preset=debug", "--model.dim=768", "--model.n_layers=6", "--model.ffn_dim=2048",
         "--model.n_heads=12", "--model.n_kv_heads=4", "--model.vocab_size=8192"]
SEQ_LEN, MICRO_BATCH, WARMUP, LORA_RANK, LORA_ALPHA = 64, 1, 2, 8, 16.0
# FSDP1's full state dict with offload_to_cpu=True is broken when the compute device is the CPU (torch 2.13):
#  - model: FlatParamHandle.to_cpu() calls flat_param_to(cpu) (a no-op, the same storage) and then
#    _free_unsharded_flat_param(), so state_dict()'s clone() reads freed memory: SIGSEGV on rank 0;
#  - optimizer: _allgather_orig_param_states all-gathers every state (exp_avg, exp_avg_sq) into ONE reused
#    buffer and, with cpu_offload, copies out only through .cpu() (a no-op) instead of .clone(): exp_avg comes
#    back as a view of exp_avg_sq's values, silently (the default FullOptimStateDictConfig has offload True).
# On a CPU run there is nothing to offload, so False is the same memory-wise; rank0_only stays True.
OFFLOAD = False
VARIANTS = ("FSDP1", "FSDP2")


# glibc's mallopt parameter, and the threshold --malloc mmap sets (see the module docstring)
M_MMAP_THRESHOLD, MMAP_THRESHOLD = -3, 256 * 1024


# -- the two setups ------------------------------------------------------------------------------------

class Setup:
    """A wrapped model + optimizer + how to clip, how to count its gradients, how to checkpoint it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def clip(self) -> torch.Tensor:
        raise NotImplementedError

    def grad_bytes(self) -> int:
        raise NotImplementedError

    def save(self, folder: Path, step: int) -> Path:
        raise NotImplementedError

    def trainable_bytes(self) -> int:
        return local_bytes(p for p in self.model.parameters() if p.requires_grad)

    def state_bytes(self) -> int:
        """This rank's params + AdamW state."""
        return local_bytes(state_tensors(self.model, self.optimizer))


class FSDP1Setup(Setup):
    def __init__(self, cfg, mc, lora: bool, use_orig_params: bool = True):
        with torch.device("meta"):
            model = Transformer(mc)
        if lora:
            apply_lora(model, LORA_RANK, LORA_ALPHA)
        model.to_empty(device="cpu")
        model.init_weights(seed=cfg.train.seed)  # the values FSDP2's shard-wise init gives (name + seed only)
        ndim = {n: p.ndim for n, p in model.named_parameters()}
        self.model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=use_orig_params,
                          device_id=torch.device("cpu"))
        t = cfg.train
        decay, no_decay = [], []
        for n, p in self.model.named_parameters():  # shardlm's groups, by the unwrapped shapes
            if p.requires_grad:
                (decay if ndim[n.replace("_fsdp_wrapped_module.", "")] >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=t.lr, betas=(t.beta1, t.beta2),
                                           eps=t.eps)
        self.max_norm = t.grad_clip

    def clip(self) -> torch.Tensor:
        return self.model.clip_grad_norm_(self.max_norm)

    def grad_bytes(self) -> int:
        handles = [m._handle for m in FSDP.fsdp_modules(self.model) if m._handle is not None]
        return local_bytes(h.flat_param.grad for h in handles if h.flat_param.grad is not None)

    def save(self, folder: Path, step: int) -> Path:
        path = folder / f"full-{step}.pt"
        # offload_to_cpu=False (see OFFLOAD): nothing to offload on a CPU run, and with True FSDP1 breaks there.
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=OFFLOAD, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=OFFLOAD, rank0_only=True)):
            msd = self.model.state_dict()
            osd = FSDP.optim_state_dict(self.model, self.optimizer)
        if dist.get_rank() == 0:
            aliased = [k for k, v in osd["state"].items()
                       if v["exp_avg"].untyped_storage().data_ptr() == v["exp_avg_sq"].untyped_storage().data_ptr()]
            if aliased:  # O(1) per param; would be a corrupt checkpoint
                raise RuntimeError(f"FSDP.optim_state_dict: exp_avg and exp_avg_sq share memory for {len(aliased)} "
                                   f"params (e.g. {aliased[0]})")
            folder.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                torch.save({"model": msd, "optim": osd, "step": torch.tensor(step)}, f)
                f.flush()
                os.fsync(f.fileno())
        del msd, osd
        dist.barrier()
        return path


class FSDP2Setup(Setup):
    def __init__(self, cfg, mc, mesh, lora: bool):
        if lora:
            cfg = load_config(None, CFG_ARGS + [f"--lora.rank={LORA_RANK}", f"--lora.alpha={LORA_ALPHA}"])
        self.cfg = cfg
        self.model = build_model(cfg, mc, mesh, torch.device("cpu"))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, cfg.train, torch.device("cpu"))

    def clip(self) -> torch.Tensor:
        return clip_grad_norm_(self.params, self.cfg.train.grad_clip)

    def grad_bytes(self) -> int:
        return local_bytes(p.grad for p in self.model.parameters() if p.grad is not None)

    def save(self, folder: Path, step: int) -> Path:
        ck = Checkpointer(self.cfg.checkpoint, folder, dist.get_rank(), self.model, self.optimizer,
                          {"trainer": {"step": torch.tensor(step)}}, log=lambda line: None, forms=STORED_FORMS)
        ck.save(step, blocking=True)
        return folder / f"step-{step}"


CFG_ARGS = [*MODEL, "--train.mixed_precision=fp32", "--train.device=cpu", f"--data.seq_len={SEQ_LEN}",
            f"--train.micro_batch_size={MICRO_BATCH}", "--checkpoint.async=false", "--checkpoint.keep_last=0",
            "--checkpoint.resume=none"]


def batches(n: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's n batches: the same for every variant."""
    out = []
    for k in range(n):
        g = torch.Generator().manual_seed(1000 * dist.get_rank() + k)
        t = torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


PHASES = ("step", "fwd_bwd", "clip", "optim")


def train_steps(s: Setup, data, on_backward=None) -> tuple[list[list[float]], float]:
    """One step per batch -> (per step, the slowest rank's wall seconds of [whole step, forward + backward, clip,
    AdamW step + zero_grad]; the global mean loss of the last step)."""
    times, loss = [], None
    for x, y in data:
        t0 = time.perf_counter()
        loss = F.cross_entropy(s.model(x).flatten(0, 1), y.flatten())
        loss.backward()
        t1 = time.perf_counter()
        if on_backward is not None:
            on_backward()
        t2 = time.perf_counter()
        s.clip()
        t3 = time.perf_counter()
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        times.append([t4 - t0 - (t2 - t1), t1 - t0, t3 - t2, t4 - t3])
    loss = loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    flat = slowest([v for row in times for v in row])
    return [flat[i:i + len(PHASES)] for i in range(0, len(flat), len(PHASES))], loss.item()


def medians(times: list[list[float]]) -> dict[str, float]:
    return {name: statistics.median(row[i] for row in times) for i, name in enumerate(PHASES)}


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


# -- benchmark -------------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    """The command line; with --malloc mmap (the default) also sets glibc's mmap threshold."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="builds of each variant, order alternating (default 2)")
    ap.add_argument("--steps", type=int, default=8, help=f"timed steps per build, after {WARMUP} warmup (default 8)")
    ap.add_argument("--lora-steps", type=int, default=3, help="timed LoRA steps, after 1 warmup (default 3)")
    ap.add_argument("--malloc", choices=("mmap", "default"), default="mmap",
                    help="mmap (default): mallopt(M_MMAP_THRESHOLD, 256 KiB), so every tensor >= 256 KiB is its own "
                    "mapping, returned to the kernel when freed, and RSS follows live memory; default: glibc's dynamic "
                    "threshold (freed tensors stay in the heap: RSS also counts memory glibc caches)")
    ap.add_argument("--save", action="store_true", help=f"also write the report to {RESULT.relative_to(ROOT)}")
    args = ap.parse_args()
    if args.repeats < 1 or args.steps < 1 or args.lora_steps < 1:
        ap.error("--repeats, --steps and --lora-steps must be >= 1")
    if args.malloc == "mmap":
        if LIBC is None or not LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
            ap.error("--malloc mmap needs glibc's mallopt; pass --malloc default")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    warnings.filterwarnings("ignore", message=r"FSDP.state_dict_type\(\) and FSDP.set_state_dict_type\(\) are being "
                            "deprecated", category=FutureWarning)
    dist.init_process_group("gloo")
    rank0 = dist.get_rank() == 0
    tmp = shared_tmpdir("shardlm-fsdp1v2-", "/tmp")
    bench = Bench(dist.get_world_size())
    data = batches(WARMUP + args.steps, bench.mc.vocab_size)
    res = measure_training(bench, args, data, tmp)
    lora = measure_lora(bench, data[:1 + args.lora_steps])
    if rank0:
        report(report_lines(bench, args, res, lora), RESULT if args.save else None)
    dist.barrier()
    shutdown_distributed()  # frees the gloo threads before interpreter shutdown
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)


class Bench:
    """The model shape both variants share, and the mesh FSDP2 shards over."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.cfg = load_config(None, CFG_ARGS)
        mc = build_model_config(self.cfg, 257)  # the byte tokenizer's vocab; vocab_size 8192 covers it
        # build_model_config keeps the preset's head_dim (debug: 128 // 4 = 32) when model.dim / model.n_heads are
        # overridden (dataclasses.replace passes the __post_init__-filled value on); set dim // n_heads = 64 here.
        self.mc = dataclasses.replace(mc, head_dim=mc.dim // mc.n_heads)
        self.mesh = ParallelDims(1, -1, world).build_mesh("cpu")

    def build(self, which: str, lora: bool = False, use_orig_params: bool = True) -> Setup:
        if which == "FSDP1":
            return FSDP1Setup(self.cfg, self.mc, lora, use_orig_params)
        return FSDP2Setup(self.cfg, self.mc, self.mesh, lora)


def measure_training(bench: Bench, args, data, tmp: Path) -> dict[str, list[dict]]:
    """Full training: build, steps, checkpoint; each variant built afresh per repeat, order alternating."""
    res: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        for which in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            out = train_and_save(bench, which, data, tmp, WARMUP + args.steps)
            res[which].append(out)
            mem, step_t, loss, save_t = out["mem"], out, out["loss"], out["save"]
            say(f"[{r + 1}/{args.repeats}] {which}: step {step_t['step']:.2f} s (median of "
                f"{args.steps}), loss {loss:.5f}, train peak +{mem[0][2] / MiB:.0f} MiB (rank 0), save "
                f"{save_t:.2f} s +{mem[0][4] / MiB:.0f} MiB (rank 0)")
    return res


def train_and_save(bench: Bench, which: str, data, tmp: Path, step: int) -> dict:
    """One build of `which`: its phases' median times, last loss, save time, per-rank memory, bytes on disk."""
    settle()
    dist.barrier()
    base = rss()
    with PeakRSS() as m_build:
        s = bench.build(which)
    settle()
    dist.barrier()
    with PeakRSS(base=base) as m_train:
        times, loss = train_steps(s, data)
    state_b = s.state_bytes()
    step_t = medians(times[WARMUP:])
    settle()
    dist.barrier()
    t0 = time.perf_counter()
    with PeakRSS() as m_save:
        path = s.save(tmp / which, step)
    save_t = slowest([time.perf_counter() - t0])[0]
    disk = du(path) if dist.get_rank() == 0 else 0
    clear(tmp / which)
    mem = gather([m_build.added, m_build.hwm_added, m_train.added, m_train.hwm_added, m_save.added,
                  m_save.hwm_added, float(state_b), float(base)])
    del s
    settle()
    return {**step_t, "loss": loss, "save": save_t, "mem": mem, "disk": disk}


LORA_VARIANTS = (("FSDP1 use_orig_params=False", "FSDP1", False), ("FSDP1 use_orig_params=True", "FSDP1", True),
                 ("FSDP2", "FSDP2", True))


def measure_lora(bench: Bench, data) -> dict[str, dict]:
    """LoRA-style partial freezing, each way of wrapping once: runs or raises, its figures, its FSDP warnings."""
    lora: dict[str, dict] = {}
    for name, which, orig in LORA_VARIANTS:
        out = lora_run(bench, which, orig, data)
        lora[name] = out
        say(f"LoRA, {name}: " + (f"runs, step {out['step']:.2f} s, loss {out['loss']:.5f}, grads after backward "
                                 f"{out['mem'][0][2] / MiB:.1f} MiB (rank 0)" if out["ok"] else out["error"]))
    return lora


def lora_run(bench: Bench, which: str, orig: bool, data) -> dict:
    settle()
    dist.barrier()
    base = rss()
    out: dict = {"warnings": []}
    s = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            s = bench.build(which, lora=True, use_orig_params=orig)
            settle()
            dist.barrier()
            grads = []
            with PeakRSS(base=base) as m:
                times, loss = train_steps(s, data, on_backward=lambda: grads.append(s.grad_bytes()))
            out.update(ok=True, **medians(times[1:]), loss=loss,
                       mem=gather([m.added, m.hwm_added, float(max(grads)), float(s.trainable_bytes()),
                                   float(s.state_bytes())]))
        except Exception as e:  # every rank raises the same (the check runs before any collective)
            out.update(ok=False, error=first_line(e))
    out["warnings"] = fsdp_warnings(caught)
    s = None  # drop the model before settle() (not `del`: the on_backward lambda closes over s)
    settle()
    return out


def fsdp_warnings(caught) -> list[str]:
    """FSDP's warnings, one line each; the same message for several units once, naming them."""
    seen: dict[str, list[str]] = {}  # message with the unit name generalised -> unit names
    for w in caught:
        line = str(w.message).strip().splitlines()[0] if str(w.message).strip() else ""
        if "fsdp" in w.filename.lower():
            m = re.match(r"(layers\.\d+) ", line)
            key = line if m is None else "<unit>" + line[m.end(1):]
            seen.setdefault(key, []).append(m.group(1) if m else "")
    out = []
    for key, units in seen.items():
        text = key.replace("<unit>", units[0], 1)
        more = f" (same for {', '.join(units[1:])})" if len(units) > 1 else ""
        out.append(f"{text}{more}")
    return out


# -- report ------------------------------------------------------------------------------------------

def training_rows(res: dict, world: int, args) -> list[tuple[str, dict]]:
    """The table's rows of the full-training part: (metric, {variant: cell})."""
    med = statistics.median

    def per_rank(which: str, i: int) -> str:
        return " / ".join(f"{med(x['mem'][k][i] for x in res[which]) / MiB:.0f}" for k in range(world))

    def cell(which: str, key: str, fmt: str) -> str:
        return format(med(x[key] for x in res[which]), fmt)

    return [
        ("build + wrap: peak RSS added, MiB (r0 / r1)", {v: per_rank(v, 0) for v in VARIANTS}),
        ("  (VmHWM)", {v: per_rank(v, 1) for v in VARIANTS}),
        ("local params + AdamW state, MiB (r0 / r1)", {v: per_rank(v, 6) for v in VARIANTS}),
        ("training: peak RSS over pre-build, MiB (r0 / r1)", {v: per_rank(v, 2) for v in VARIANTS}),
        ("  (VmHWM)", {v: per_rank(v, 3) for v in VARIANTS}),
        (f"step time, s (median of {args.steps}, slowest rank)", {v: cell(v, "step", ".3f") for v in VARIANTS}),
        ("  forward + backward", {v: cell(v, "fwd_bwd", ".3f") for v in VARIANTS}),
        ("  clip_grad_norm_", {v: cell(v, "clip", ".3f") for v in VARIANTS}),
        ("  AdamW step + zero_grad", {v: cell(v, "optim", ".3f") for v in VARIANTS}),
        (f"loss after {WARMUP + args.steps} steps (global mean)", {v: cell(v, "loss", ".5f") for v in VARIANTS}),
        ("checkpoint save time, s", {v: cell(v, "save", ".2f") for v in VARIANTS}),
        ("checkpoint save: peak RSS added, MiB (r0 / r1)", {v: per_rank(v, 4) for v in VARIANTS}),
        ("  (VmHWM)", {v: per_rank(v, 5) for v in VARIANTS}),
        ("checkpoint on disk, MiB", {v: format(med(x["disk"] for x in res[v]) / MiB, ".0f") for v in VARIANTS}),
    ]


def lora_rows(lora: dict, world: int, args) -> list[tuple[str, dict]]:
    """The table's rows of the LoRA part: FSDP1 use_orig_params=True vs FSDP2 ("raises" where it did)."""
    l_off, l_on, l_2 = (lora["FSDP1 use_orig_params=False"], lora["FSDP1 use_orig_params=True"], lora["FSDP2"])

    def lcell(o: dict, f) -> str:
        return f(o) if o["ok"] else "raises"

    def lmem(o: dict, i: int, digits: int = 1) -> str:
        return " / ".join(f"{o['mem'][k][i] / MiB:.{digits}f}" for k in range(world))

    return [
        ("LoRA, FSDP1 use_orig_params=False", {"FSDP1": lcell(l_off, lambda o: "runs"), "FSDP2": "n/a (no flat params)"}),
        ("LoRA, FSDP1 use_orig_params=True / FSDP2", {"FSDP1": lcell(l_on, lambda o: "runs"),
                                                      "FSDP2": lcell(l_2, lambda o: "runs")}),
        (f"  step time, s (median of {args.lora_steps})", {"FSDP1": lcell(l_on, lambda o: f"{o['step']:.3f}"),
                                                         "FSDP2": lcell(l_2, lambda o: f"{o['step']:.3f}")}),
        ("    forward + backward", {"FSDP1": lcell(l_on, lambda o: f"{o['fwd_bwd']:.3f}"),
                                   "FSDP2": lcell(l_2, lambda o: f"{o['fwd_bwd']:.3f}")}),
        (f"  loss after {1 + args.lora_steps} steps", {"FSDP1": lcell(l_on, lambda o: f"{o['loss']:.5f}"),
                                                     "FSDP2": lcell(l_2, lambda o: f"{o['loss']:.5f}")}),
        ("  trainable params, local MiB (r0 / r1)", {"FSDP1": lcell(l_on, lambda o: lmem(o, 3, 2)),
                                                     "FSDP2": lcell(l_2, lambda o: lmem(o, 3, 2))}),
        ("  grads held after backward, MiB (r0 / r1)", {"FSDP1": lcell(l_on, lambda o: lmem(o, 2, 2)),
                                                       "FSDP2": lcell(l_2, lambda o: lmem(o, 2, 2))}),
        ("  local params + AdamW state, MiB (r0 / r1)", {"FSDP1": lcell(l_on, lambda o: lmem(o, 4, 0)),
                                                        "FSDP2": lcell(l_2, lambda o: lmem(o, 4, 0))}),
        ("  training: peak RSS over pre-build, MiB (r0 / r1)", {"FSDP1": lcell(l_on, lambda o: lmem(o, 0, 0)),
                                                               "FSDP2": lcell(l_2, lambda o: lmem(o, 0, 0))}),
        ("    (VmHWM)", {"FSDP1": lcell(l_on, lambda o: lmem(o, 1, 0)), "FSDP2": lcell(l_2, lambda o: lmem(o, 1, 0))}),
    ]


def header_lines(bench: Bench, args, res: dict) -> list[str]:
    """The setup: machine, model, the two variants, how it was measured."""
    mc, world = bench.mc, bench.world
    base_rss = [statistics.median(x["mem"][k][7] for x in res["FSDP2"]) / MiB for k in range(world)]
    return [
        f"shardlm FSDP1 vs FSDP2 benchmark: {world} ranks, gloo on cpu ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, shared), {torch.get_num_threads()} thread/rank, torch {torch.__version__}",
        f"model debug preset + {' '.join(a[2:] for a in MODEL[1:])}: {mc.num_params() / 1e6:.2f}M params "
        f"(head_dim {mc.head_dim}; {mc.num_params() * 4 / MiB:.0f} MiB fp32, with 2 AdamW moments "
        f"{mc.num_params() * 12 / MiB:.0f} MiB); seq_len {SEQ_LEN} x micro_batch {MICRO_BATCH} per rank, random "
        "token ids (same per rank and step for both), same initial weights",
        "FSDP1 = FullyShardedDataParallel(ModuleWrapPolicy({Block}), use_orig_params=True, device_id=cpu), "
        f"full-state-dict checkpoint (rank0_only=True, offload_to_cpu={OFFLOAD}: True segfaults / aliases the "
        "AdamW moments on CPU, see the script) -> rank-0 torch.save + fsync;",
        "FSDP2 = shardlm.build.build_model (fully_shard per block, then root) + build_optimizer, "
        "shardlm Checkpointer.save(blocking=True) (DCP, fsync).",
        f"step = forward + mean CE + backward + clip(1.0) + AdamW + zero_grad. {args.repeats} builds of each "
        f"variant, order alternating; {WARMUP} warmup + {args.steps} timed steps each; medians over builds. "
        "RSS sampled every 5 ms (VmHWM = kernel peak since a clear_refs reset); pre-build baseline "
        f"RSS ~{' / '.join(f'{b:.0f}' for b in base_rss)} MiB. malloc: "
        + ("mallopt(M_MMAP_THRESHOLD, 256 KiB): tensors >= 256 KiB are own mappings, unmapped when freed, so RSS "
           "follows live memory (--malloc default: glibc's dynamic threshold, RSS also counts freed heap memory)."
           if args.malloc == "mmap" else "glibc default (dynamic mmap threshold: RSS also counts freed heap memory)."),
        "",
    ]


def report_lines(bench: Bench, args, res: dict, lora: dict) -> list[str]:
    """The header, the table (training rows, then LoRA rows), each LoRA way's outcome, every build's times."""
    rows = training_rows(res, bench.world, args) + lora_rows(lora, bench.world, args)
    w0 = max(len(r[0]) for r in rows) + 2
    w1 = max(max(len(c) for r in rows for c in r[1].values()), 12) + 2
    lines = [
        *header_lines(bench, args, res),
        f"{'metric':<{w0}}" + "".join(f"{v:>{w1}}" for v in VARIANTS),
        *(f"{name:<{w0}}" + "".join(f"{c[v]:>{w1}}" for v in VARIANTS) for name, c in rows),
        "",
        f"LoRA: apply_lora(rank {LORA_RANK}, alpha {LORA_ALPHA:g}, all 7 linears of every block) before wrapping; "
        f"1 warmup + {args.lora_steps} timed steps.",
    ]
    for name, o in lora.items():
        lines.append(f"  {name}: " + ("runs" if o["ok"] else f"raises {o['error']}"))
        lines += [f"    warning: {w}" for w in o["warnings"]]
    return lines + [
        "",
        "per build: " + "; ".join(f"{v} step " + ", ".join(f"{x['step']:.3f}" for x in res[v]) + " s, save "
                                  + ", ".join(f"{x['save']:.2f}" for x in res[v]) + " s" for v in VARIANTS),
    ]


if __name__ == "__main__":
    main()
