"""`shardlm bench comm`: FSDP's collectives over each dimension of the configured mesh, in nccl-tests' terms.

Every rank runs all-gather, reduce-scatter and all-reduce over each mesh dimension (its own group
along that dimension; all groups of a dimension at once, as FSDP runs them), at the sizes FSDP
sends for the configured model (one block's parameters; for the HSDP all-reduce one block's
gradient shard) and over a sweep (1 MiB x4 up to --max-size). Numbers follow nccl-tests
(doc/PERFORMANCE.md): S is the unsharded size for all-gather / reduce-scatter (each rank holds
S/n) and the per-rank size for all-reduce; algbw = S / t; busbw = algbw x (n-1)/n (all-gather,
reduce-scatter) or 2(n-1)/n (all-reduce), the speed of the bottleneck link; GB = 1e9 bytes. t is
the median over --iters of one rank's time, the max over ranks (a collective is as slow as its
slowest rank), each iteration started by a group-wide sync.

A dimension whose busbw is far below the best one's is flagged: on GPUs that is the NVLink-domain
cliff (~800 GB/s inside, ~100-200 GB/s across), and the fix is the HSDP layout (dp_shard inside a
domain, dp_replicate across). Last, `step_traffic` + `estimate_step` turn the model's sizes and the
measured bandwidths into the share of a training step the FSDP collectives would take, with no
overlap (an upper bound: FSDP2 prefetches all-gathers and reduce-scatters on side streams).
"""

from __future__ import annotations

import functools
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from shardlm.config import Config
from shardlm.errors import ConfigError
from shardlm.models.llama import OutputHead
from shardlm.parallel.launch import plan_launch
from shardlm.build import build_model_config, meta_model, model_state_bytes
from shardlm.distributed.env import device_type
from shardlm.observe.metrics import peak_flops
from shardlm.parallel.fsdp import DTYPES, unsharded_blocks

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
MIB = 2**20
CPU_MAX_SIZE = 64 * MIB  # gloo on a laptop at 1 GiB x ranks takes minutes and GiBs of RAM
GPU_MAX_SIZE = 1024 * MIB
SWEEP_MIN = 1 * MIB
DEFAULT_FLAG_RATIO = 0.25
ASSUMED_MFU = 0.4  # achieved / peak bf16 FLOP/s on a known GPU

# torch 2.13 renamed the tensor collectives (the old names warn); torch 2.11 has only the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# -- sizes and nccl-tests' definitions -----------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9}


def parse_size(text: str) -> int:
    """`1MiB`, `4M` (binary), `1MB` (decimal), `1048576` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"bad size {text!r}: use a positive number with an optional unit B, KiB, MiB, GiB "
                          "(or K, M, G; KB, MB, GB are powers of 10)")
    return int(float(m.group(1)) * _UNITS[unit])


def sweep_sizes(max_size: int, min_size: int = SWEEP_MIN) -> list[int]:
    """min_size, x4, ... up to max_size (max_size itself always included)."""
    sizes, s = [], min_size
    while s < max_size:
        sizes.append(s)
        s *= 4
    return sizes + [max_size]


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' busbw / algbw: 2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    raise ValueError(f"unknown collective {collective!r}")


def fmt_size(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"


# -- what FSDP sends for the configured model ----------------------------------------------------

@dataclass(frozen=True)
class ModelBytes:
    """Parameter counts of the FSDP units (every block is one, the root holds the rest) and dtype sizes."""

    n_blocks: int
    block_params: int
    block_trainable: int
    root_params: int  # embeddings, final norm, output head
    root_trainable: int
    param_size: int  # bytes per element of the all-gathered parameters (the mixed-precision param dtype)
    grad_size: int  # bytes per element of the reduced gradients (train.reduce_dtype)
    regathered: int = 0  # root parameters gathered again in backward: an untied embedding (its own unit)

    @property
    def block_gather_bytes(self) -> int:
        return self.block_params * self.param_size

    @property
    def block_reduce_bytes(self) -> int:
        return self.block_trainable * self.grad_size


def model_bytes(cfg: Config, mc: Any, device_type: str) -> tuple[ModelBytes, str, str]:
    """(ModelBytes, param dtype name, reduce dtype name) of cfg's model (`mc`), counted on the meta device."""
    model = meta_model(cfg, mc)
    block = list(model.layers[0].parameters())
    in_blocks = {id(p) for layer in model.layers for p in layer.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    precision = cfg.train.precision(device_type)
    param_dtype = "bf16" if precision == "fp8" else precision
    mb = ModelBytes(
        n_blocks=len(model.layers),
        block_params=sum(p.numel() for p in block), block_trainable=sum(p.numel() for p in block if p.requires_grad),
        root_params=sum(p.numel() for p in root), root_trainable=sum(p.numel() for p in root if p.requires_grad),
        param_size=DTYPES[param_dtype].itemsize, grad_size=DTYPES[cfg.train.reduce_dtype].itemsize,
        regathered=model.embed_tokens.weight.numel() if isinstance(model.lm_head, OutputHead) else 0)
    return mb, param_dtype, cfg.train.reduce_dtype


# -- the step estimate (pure) --------------------------------------------------------------------

@dataclass
class Traffic:
    """Bytes (nccl-tests' S) each FSDP collective moves per optimizer step on one rank, and what they are."""

    all_gather: int
    reduce_scatter: int
    all_reduce: int
    detail: dict[str, str]


def step_traffic(mb: ModelBytes, dp_shard: int, dp_replicate: int, reshard_after_forward: int | bool | str = True,
                 grad_accum: int = 1, grad_sync: str = "micro_batch", spare_bytes: int | None = None) -> Traffic:
    """What FSDP2 sends in one optimizer step, as `shardlm.parallel.fsdp.apply_fsdp` shards the model.

    Per micro-batch: forward all-gathers every block and the root's parameters; the backward gathers the blocks
    again, except the last k that keep their parameters (`parallel.fsdp.unsharded_blocks`: k = 1 with true,
    every block with false, auto from `spare_bytes`, the memory a run finds free at its peak), and an untied
    embedding (its own unit, resharded after forward unless false); the head unit keeps its parameters to its
    backward.
    Gradients (only the trainable ones: LoRA freezes the rest) are reduce-scattered after every
    micro-batch (grad_sync=micro_batch) or once (step); HSDP all-reduces the reduce-scattered
    shards across replicas once per step. Per-parameter padding to a multiple of dp_shard is ignored.
    """
    L, raf = mb.n_blocks, reshard_after_forward
    grads = (L * mb.block_trainable + mb.root_trainable) * mb.grad_size
    ag = rs = 0
    detail = {c: "none" for c in COLLECTIVES}
    if dp_shard > 1:
        k, _ = unsharded_blocks(raf, L, mb.block_params * mb.param_size, spare_bytes)
        bwd_blocks, again = L - k, (mb.regathered if raf is not False else 0)
        ag = ((L + bwd_blocks) * mb.block_params + mb.root_params + again) * mb.param_size * grad_accum
        emb = " + the embedding again" if again else ""
        detail["all_gather"] = (f"({L} fwd + {bwd_blocks} bwd) blocks + root{emb} x {grad_accum} micro-batch(es)")
        reductions = grad_accum if grad_sync == "micro_batch" else 1
        rs = grads * reductions
        detail["reduce_scatter"] = f"trainable grads of {L} blocks + root x {reductions}"
    ar = grads // dp_shard if dp_replicate > 1 else 0
    if ar:
        detail["all_reduce"] = f"trainable grads / dp_shard {dp_shard} x 1"
    return Traffic(ag, rs, ar, detail)


@dataclass
class StepEstimate:
    comm_s: dict[str, float | None]  # per collective; None where it moves bytes but has no bandwidth
    total_comm_s: float
    compute_s: float
    fraction: float  # comm / (comm + compute): the share of the step with no overlap at all
    missing: list[str]


def estimate_step(traffic: Traffic, algbw: Mapping[str, float | None], flops_per_step: float,
                  flops_per_s: float) -> StepEstimate:
    """Comm time = bytes / algbw (bytes/s, measured at the FSDP message size) per collective; compute
    time = FLOPs / achieved FLOP/s; their ratio as if nothing overlapped."""
    comm: dict[str, float | None] = {}
    for c in COLLECTIVES:
        nbytes, bw = getattr(traffic, c), algbw.get(c)
        comm[c] = 0.0 if nbytes == 0 else (nbytes / bw if bw else None)
    total = sum(t for t in comm.values() if t is not None)
    compute = flops_per_step / flops_per_s
    frac = total / (total + compute) if total + compute > 0 else 0.0
    return StepEstimate(comm, total, compute, frac, [c for c, t in comm.items() if t is None])


def flag_slow_dims(busbw: Mapping[str, float], ratio: float = DEFAULT_FLAG_RATIO) -> list[tuple[str, str, float]]:
    """(slow dim, best dim, slow/best) for every dimension whose busbw is below `ratio` x the best one's."""
    if len(busbw) < 2:
        return []
    best = max(busbw, key=busbw.__getitem__)
    return [(d, best, bw / busbw[best]) for d, bw in busbw.items() if d != best and bw < ratio * busbw[best]]


# -- measuring -----------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_op(collective: str, size: int, n: int, dtype: torch.dtype, device: torch.device,
             group: dist.ProcessGroup) -> tuple[Callable[[], Any], int]:
    """The collective over buffers allocated once, and the S it moves (`size` rounded to whole shards)."""
    esize = dtype.itemsize
    if collective == "all_reduce":
        full = torch.zeros(max(size // esize, 1), dtype=dtype, device=device)
        return (lambda: dist.all_reduce(full, group=group)), full.numel() * esize
    numel = max(size // (esize * n), 1) * n
    full = torch.zeros(numel, dtype=dtype, device=device)
    if collective == "all_to_all":  # parallel.cp's exchange: S = each rank's buffer, 1/n of it to each peer
        out = torch.zeros_like(full)
        return (lambda: dist.all_to_all_single(out, full, group=group)), numel * esize
    shard = torch.zeros(numel // n, dtype=dtype, device=device)
    if collective == "all_gather":
        return (lambda: _ALL_GATHER(full, shard, group=group)), numel * esize
    return (lambda: _REDUCE_SCATTER(shard, full, group=group)), numel * esize


def _time_op(op: Callable[[], Any], group: dist.ProcessGroup, device: torch.device, iters: int,
             warmup: int) -> float:
    """Median seconds of `op` on this rank, each run started together by a one-element all-reduce on the group."""
    start = torch.zeros(1, device=device)
    times = []
    for i in range(warmup + iters):
        dist.all_reduce(start, group=group)
        _sync(device)
        t0 = time.perf_counter()
        op()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure(collective: str, size: int, n: int, dtype: torch.dtype, device: torch.device,
             group: dist.ProcessGroup, iters: int, warmup: int) -> tuple[int, float | None, str | None]:
    """(S, median seconds, None) or (S, None, why) when the backend cannot run it.

    A backend that lacks a collective fails on every rank alike, so no rank is left waiting."""
    try:
        op, nbytes = _make_op(collective, size, n, dtype, device, group)
    except torch.OutOfMemoryError:
        return size, None, "out of memory"
    try:
        return nbytes, _time_op(op, group, device, iters, warmup), None
    except (RuntimeError, NotImplementedError) as e:
        return nbytes, None, f"not supported here: {str(e).splitlines()[0][:120]}"


def achieved_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """Achieved matmul FLOP/s of this rank: ASSUMED_MFU x the datasheet peak on a known GPU in bf16,
    else a timed square matmul."""
    peak = peak_flops(device)
    if peak is not None and dtype == torch.bfloat16:
        return ASSUMED_MFU * peak, (f"assumed {ASSUMED_MFU:.0%} of the {torch.cuda.get_device_name(device)} bf16 "
                                    f"peak {peak / 1e12:.0f} TFLOP/s")
    n = 1024 if device.type == "cpu" else 8192
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    times = []
    for _ in range(4):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times[1:]), f"timed {n}x{n} {str(dtype).removeprefix('torch.')} matmul"


# -- the benchmark -------------------------------------------------------------------------------

def run_comm_bench(cfg: Config, sizes: list[int] | None = None, max_size: int | None = None, iters: int | None = None,
                   warmup: int | None = None, flag_ratio: float = DEFAULT_FLAG_RATIO) -> dict[str, Any]:
    """Measure on every rank (joining or making the process group); returns the report (complete on rank 0)."""
    # Everything that can be wrong with the config fails here, before any collective.
    dev_type = device_type(cfg.train.device)
    cuda = dev_type == "cuda"
    iters = iters if iters is not None else (20 if cuda else 5)
    warmup = warmup if warmup is not None else (5 if cuda else 1)
    if iters < 1 or warmup < 0:
        raise ConfigError(f"--iters must be >= 1 and --warmup >= 0, got {iters} and {warmup}")
    mc = build_model_config(cfg, 0)  # vocab 0: no tokenizer needed
    plan = plan_launch(cfg.parallel, cfg.train.device, functools.partial(model_state_bytes, cfg, mc))
    pdims, reason = plan.dims, plan.reason
    mb, param_dtype, reduce_dtype = model_bytes(cfg, mc, dev_type)
    notes = []
    if sizes is None:
        if max_size is None and not cuda:
            notes.append(f"on CPU the sweep stops at {fmt_size(CPU_MAX_SIZE)} (gloo at 1 GiB x ranks takes minutes "
                         "and GiBs of RAM); --max-size 1GiB goes further")
        sizes = sweep_sizes(max_size or (GPU_MAX_SIZE if cuda else CPU_MAX_SIZE))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not cuda and local > (os.cpu_count() or 1):
        notes.append(f"{local} ranks share {os.cpu_count()} CPU cores here: the times include waiting for a core")

    env = plan.start()
    fsdp = {"all_gather": ("fsdp: one block's params", mb.block_gather_bytes, param_dtype),
            "reduce_scatter": ("fsdp: one block's grads", mb.block_reduce_bytes, reduce_dtype),
            "all_reduce": (f"fsdp: one block's grad shard (/{pdims.dp_shard})",
                           mb.block_reduce_bytes // pdims.dp_shard, reduce_dtype)}
    if pdims.cp > 1:  # one attention layer's exchange: this rank's q, k and v slice (the output comes back alike)
        tokens = cfg.train.micro_batch_size * cfg.data.seq_len // pdims.cp
        fsdp["all_to_all"] = (f"cp: one layer's q, k, v ({tokens} tokens)", tokens * mc.head_dim *
                              (mc.n_heads + 2 * mc.n_kv_heads) * DTYPES[param_dtype].itemsize, param_dtype)
    rows, dims = measure_mesh(plan.build_mesh(env), fsdp, sizes, env.device, iters, warmup)
    notes += [f"{d['name']}: 1 rank per group, nothing to measure (skipped)" for d in dims if d["skipped"]]
    largest = busbw_at_largest(rows)
    flags = [_flag_line(slow, best, frac, largest, flag_ratio)
             for slow, best, frac in flag_slow_dims(largest, flag_ratio)]
    estimate, more_notes = _step_estimate(cfg, mc, mb, pdims, rows, env.device, param_dtype)
    return {
        "world_size": env.world_size, "backend": env.backend, "device": str(env.device), "torch": torch.__version__,
        "mesh": {"dp_replicate": pdims.dp_replicate, "dp_shard": pdims.dp_shard, "cp": pdims.cp},
        "mesh_reason": reason or "from the config",
        "model": {"name": cfg.model.init_from or cfg.model.preset, **asdict(mb), "param_dtype": param_dtype,
                  "reduce_dtype": reduce_dtype},
        "fsdp_sizes": {c: fsdp[c][1] for c in COLLECTIVES},
        "iters": iters, "warmup": warmup, "sweep_sizes": sizes, "dims": dims,
        "results": rows, "busbw_at_largest_gbps": largest, "flag_ratio": flag_ratio, "flags": flags,
        "step_estimate": estimate, "notes": notes + more_notes,
    }


def measure_mesh(mesh: Any, fsdp: Mapping[str, tuple[str, int, str]], sizes: list[int], device: torch.device,
                 iters: int, warmup: int) -> tuple[list[dict], list[dict]]:
    """Every collective at its FSDP size (label, bytes, dtype name) and at `sizes`, over each mesh dimension
    of more than one rank: (rows with time, algbw and busbw as the slowest rank saw them, the dimensions)."""
    world = dist.get_world_size()
    rows, dims = [], []
    for i, name in enumerate(mesh.mesh_dim_names):
        n = mesh.size(i)
        dims.append({"name": name, "ranks": n, "groups": world // n, "skipped": n == 1})
        if n == 1:
            continue
        group = mesh.get_group(name)
        for c in (("all_to_all",) if name == "cp" else COLLECTIVES):  # the CP group only exchanges activations
            fsdp_label, fsdp_size, dtype_name = fsdp[c]
            for label, size in [(fsdp_label, fsdp_size)] + [("sweep", s) for s in sizes]:
                if size <= 0:
                    continue
                nbytes, t, err = _measure(c, size, n, DTYPES[dtype_name], device, group, iters, warmup)
                rows.append({"dim": name, "ranks": n, "collective": c, "label": label,
                             "dtype": str(DTYPES[dtype_name]).removeprefix("torch."), "size_bytes": nbytes,
                             "time_s": t, "error": err})
    # The slowest rank sets the time: max over ranks, in one collective.
    t = torch.tensor([r["time_s"] if r["time_s"] is not None else -1.0 for r in rows] or [0.0],
                     dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    for r, tmax in zip(rows, t.tolist()):
        r["time_s"] = tmax if r["error"] is None else None
        ok = r["time_s"] is not None and r["time_s"] > 0
        r["algbw_gbps"] = r["size_bytes"] / r["time_s"] / 1e9 if ok else None
        r["busbw_gbps"] = r["algbw_gbps"] * bus_factor(r["collective"], r["ranks"]) if ok else None
    return rows, dims


def busbw_at_largest(rows: list[dict]) -> dict[str, float]:
    """Per dimension: the mean busbw over the collectives at its largest sweep size (what the flag compares)."""
    out = {}
    for d in dict.fromkeys(r["dim"] for r in rows):
        sweep = [r for r in rows if r["dim"] == d and r["label"] == "sweep" and r["busbw_gbps"] is not None]
        if sweep:
            top = max(r["size_bytes"] for r in sweep)
            out[d] = statistics.mean(r["busbw_gbps"] for r in sweep if r["size_bytes"] == top)
    return out


def _step_estimate(cfg: Config, mc: Any, mb: ModelBytes, pdims: Any, rows: list[dict], device: torch.device,
                   param_dtype: str) -> tuple[dict[str, Any], list[str]]:
    """The step estimate as the report holds it: all-gather and reduce-scatter at their FSDP-size algbw on
    dp_shard, the HSDP all-reduce at its algbw on dp_replicate; compute at this fabric's FLOP/s."""
    flops_per_s, source = achieved_flops(device, DTYPES[param_dtype])
    f = torch.tensor([flops_per_s], dtype=torch.float64, device=device)
    dist.all_reduce(f, op=dist.ReduceOp.MIN)  # the slowest rank sets the step
    source += ", slowest rank" if source.startswith("timed") else ""
    t = cfg.train
    free = None  # reshard_after_forward=auto: as the trainer decides, from the least free memory of any rank
    if cfg.parallel.reshard_after_forward == "auto" and device.type == "cuda" and not t.cpu_offload:
        free_t = torch.tensor([torch.cuda.mem_get_info(device)[0]], dtype=torch.int64, device=device)
        dist.all_reduce(free_t, op=dist.ReduceOp.MIN)
        free = int(free_t.item())
    traffic = step_traffic(mb, pdims.dp_shard, pdims.dp_replicate, cfg.parallel.reshard_after_forward, t.grad_accum,
                           t.grad_sync, free)
    dim_of = {"all_gather": "dp_shard", "reduce_scatter": "dp_shard", "all_reduce": "dp_replicate"}
    algbw = {c: next((r["algbw_gbps"] * 1e9 for r in rows if r["dim"] == dim_of[c] and r["collective"] == c
                      and r["label"] != "sweep" and r["algbw_gbps"]), None) for c in COLLECTIVES}
    tokens = t.micro_batch_size * cfg.data.seq_len * t.grad_accum
    flops_per_token = mc.flops_per_token(cfg.data.seq_len)
    est = estimate_step(traffic, algbw, flops_per_token * tokens, f.item())
    notes = []
    if cfg.lora.rank > 0:
        notes.append("LoRA: the all-gathers carry the frozen weights too, only the trainable parameters' gradients "
                     "are reduced; compute is counted as 6N FLOPs/token although frozen weights get no weight "
                     "gradient (~4N): the comm share is rough")
    if t.precision(device.type) == "fp8":
        notes.append("fp8: counted as bf16 all-gathers (a float8 all-gather of the linears would halve them)")
    return {
        "tokens_per_rank": tokens, "flops_per_token": flops_per_token, "flops_per_s": f.item(), "flops_source": source,
        "traffic_bytes": {c: getattr(traffic, c) for c in COLLECTIVES}, "traffic_detail": traffic.detail,
        "dims": dim_of, "algbw_gbps": {c: algbw[c] and algbw[c] / 1e9 for c in COLLECTIVES},
        "comm_ms": {c: v if v is None else v * 1e3 for c, v in est.comm_s.items()},
        "total_comm_ms": est.total_comm_s * 1e3, "compute_ms": est.compute_s * 1e3,
        "comm_fraction": est.fraction, "missing": est.missing}, notes


def _flag_line(slow: str, best: str, frac: float, busbw: Mapping[str, float], ratio: float) -> str:
    why = ("that is the HSDP layout working: only the once-per-step gradient all-reduce crosses it, the big "
           "all-gathers and reduce-scatters stay on dp_shard" if slow == "dp_replicate" else
           "FSDP's all-gathers and reduce-scatters run over it: keep dp_shard inside one NVLink domain / node "
           "and replicate across with parallel.dp_replicate (HSDP)")
    return (f"flag: {slow} busbw {busbw[slow]:.2f} GB/s is {frac:.2f}x {best}'s {busbw[best]:.2f} GB/s (< {ratio}x): "
            f"{slow} likely crosses the NVLink domain / node boundary; {why}")


# -- the text report -----------------------------------------------------------------------------

def _num(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def format_report(rep: dict[str, Any]) -> str:
    m, mesh = rep["model"], rep["mesh"]
    shape = " x ".join(f"{k}={v}" for k, v in mesh.items() if k == "dp_shard" or v > 1)
    trainable = ("all" if m["block_trainable"] == m["block_params"] and m["root_trainable"] == m["root_params"]
                 else f"{m['block_trainable']:,} per block + {m['root_trainable']:,} root")
    fs = rep["fsdp_sizes"]
    out = [
        f"shardlm bench comm: {rep['world_size']} rank(s), mesh {shape} ({rep['mesh_reason']}), "
        f"{rep['backend']} on {rep['device']}, torch {rep['torch']}",
        f"model {m['name']}: {m['n_blocks']} blocks x {m['block_params']:,} params + root {m['root_params']:,} "
        f"(embeddings, final norm, head); trainable: {trainable}",
        f"  FSDP messages: all-gather {fs['all_gather']:,} B ({m['param_dtype']}, one block), reduce-scatter "
        f"{fs['reduce_scatter']:,} B ({m['reduce_dtype']}, one block's grads), HSDP all-reduce {fs['all_reduce']:,} B "
        f"(one block's grads / dp_shard {mesh['dp_shard']})",
        f"timing: {rep['warmup']} warm-up + {rep['iters']} iterations, median per rank, max over ranks; nccl-tests "
        "definitions: S = unsharded size (all_gather, reduce_scatter) or per-rank size (all_reduce), algbw = S/t, "
        "busbw = algbw x (n-1)/n (all_gather, reduce_scatter) or 2(n-1)/n (all_reduce), GB = 1e9 B",
    ]
    out += [f"note: {n}" for n in rep["notes"]]
    for d in (d for d in rep["dims"] if not d["skipped"]):
        out += ["", f"{d['name']}: {d['ranks']} ranks per group, {d['groups']} group(s) at once"]
        for c in COLLECTIVES:
            rows = [r for r in rep["results"] if r["dim"] == d["name"] and r["collective"] == c]
            if not rows:
                continue
            out += [f"  {c} ({rows[0]['dtype']})",
                    f"    {'size (B)':>12} {'size':>10} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}"]
            for r in rows:
                label = "" if r["label"] == "sweep" else f"  {r['label']}"
                if r["error"]:
                    out.append(f"    {r['size_bytes']:>12} {fmt_size(r['size_bytes']):>10}  {r['error']}")
                    continue
                out.append(f"    {r['size_bytes']:>12} {fmt_size(r['size_bytes']):>10} {r['time_s'] * 1e6:>12.1f} "
                           f"{_num(r['algbw_gbps'], '.3f'):>13} {_num(r['busbw_gbps'], '.3f'):>13}{label}")
    out.append("")
    bw = rep["busbw_at_largest_gbps"]
    if not bw:
        out.append("flags: no dimension has more than one rank: nothing measured (launch under torchrun "
                   "--nproc_per_node N)")
    elif len(bw) < 2:
        out.append("flags: one dimension measured, nothing to compare")
    elif not rep["flags"]:
        out.append("flags: none (busbw at the largest size, mean of the collectives: "
                   + ", ".join(f"{d} {v:.2f} GB/s" for d, v in bw.items())
                   + f"; a dimension below {rep['flag_ratio']}x the best is flagged)")
    out += rep["flags"]
    out += [""] + _format_estimate(rep["step_estimate"])
    return "\n".join(out)


def _format_estimate(e: dict[str, Any]) -> list[str]:
    out = [f"step estimate per optimizer step and rank ({e['tokens_per_rank']:,} tokens = micro_batch_size x "
           "seq_len x grad_accum; comm at the algbw of the FSDP-size rows):"]
    for c in COLLECTIVES:
        nbytes, ms = e["traffic_bytes"][c], e["comm_ms"][c]
        if not nbytes:
            out.append(f"  {c:<15} none")
            continue
        out.append(f"  {c:<15} {nbytes / 1e6:10.2f} MB = {e['traffic_detail'][c]}, over {e['dims'][c]} at "
                   f"{_num(e['algbw_gbps'][c], '.3f')} GB/s -> {_num(ms, '.2f')} ms")
    gflop = e["flops_per_token"] * e["tokens_per_rank"] / 1e9
    out.append(f"  comm {e['total_comm_ms']:.2f} ms/step, compute {e['compute_ms']:.2f} ms/step ({gflop:.3g} GFLOP "
               f"at {e['flops_per_s'] / 1e9:.1f} GFLOP/s: {e['flops_source']})")
    out.append(f"  comm / (comm + compute) = {e['comm_fraction']:.2f}: the upper bound with no overlap; FSDP2 "
               "prefetches the next all-gather and reduces on side streams, so less of it is exposed")
    if e["missing"]:
        out.append(f"  not counted (no bandwidth measured): {', '.join(e['missing'])}")
    return out
