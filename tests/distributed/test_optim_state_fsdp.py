"""train.optimizer_state_dtype (bf16, int8) on real gloo groups: one 4-rank spawn checks

* the state does not depend on the number of ranks: the same parameters and gradients, 5 steps on 1, 2 and 4
  shards (dp_shard=1/2/4, the other ranks replicas: FSDP2's own sharding, one recipe), give bit-identical
  parameters and moments (the 8-bit codes and block scales, the bf16 moments);
* a resume is exact: 12 straight steps == 6 steps, save, resume, 6 more (losses, weights, state), for bf16
  and int8 (torchao's `OptimState8bit` goes through `get_state_dict` + DCP as it is: codes and scales);
* a resume on another dp degree (saved over 2 shards, resumed over 4) continues the curve, and the 8-bit state
  arrives unchanged (DCP reshards it on block boundaries);
* the state bytes per rank: bf16 half of fp32's, int8 about a quarter (codes + a scale per 256 values; small
  tensors keep fp32 moments, as in torchao);
* a sharding whose shards are not whole 256-value blocks is refused with one ConfigError line;
* with train.cpu_offload the int8 run is the same run;
* fp32 moments from a checkpoint resume under int8 (converted on load).

Seen here (torch 2.13, torchao 0.18, debug model 0.87M params, 2 shards x 2 replicas): state bytes per rank
fp32 3,478,172, bf16 1,739,164 (half, + the step counters), int8 948,124 (0.273 of fp32: 0.254 + the 1 KB code
tables that a model this small does not amortise); the 1/2/4-shard states and parameters are bit-identical; a
resume is bitwise for both; the 2 -> 4 shard resume's losses agree to 7e-8 (relative); fp32 moments resumed as
int8 agree with the int8 run that never stopped to 2e-4.

A native crash seen in this module 4 times (issue 28 item 14, CI of stop 33, a full-suite run of 2026-12-07):
a rank aborted in glibc's heap checks ("malloc(): unaligned tcache chunk", "free(): invalid pointer") inside
`full_tensor()`, in functional collectives on gloo, once on plain bf16 moments of the identity runs (no trainer,
no resume, no torchao subclass); never when the module ran alone. Valgrind's memcheck over the resume and the
reads on 4 ranks found no invalid write. So nothing here reads through DTensor's functional collectives any
more: the state is gathered with blocking c10d all_gathers (an 8-bit moment: its codes and its scales), and
`whole()` does the same for plain tensors (tests/helpers/whole.py). The 1-shard layout is read with no gather
at all (dp_replicate=4: every placement Replicate), so "1 shard == 2 == 4 shards" also checks the gathers.
shardlm itself never gathers optimizer state whole (no `full_tensor()` in src/).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.launch import run_ranks
from helpers.runs import stop_after_trainer
from helpers.whole import local, whole

STEPS, HALF = 12, 6


def _overrides(out, corpus, cache, dtype, steps=STEPS, **extra):
    o = {"model.preset": "debug", "train.steps": steps, "train.output_dir": str(out), "train.mixed_precision": "fp32",
         "train.micro_batch_size": 1, "train.lr": 3e-3, "train.warmup_steps": 3,
         "train.optimizer_state_dtype": dtype, "data.path": str(corpus), "data.seq_len": 64,
         "data.cache_dir": str(cache), "metrics.log_every": 1, "metrics.progress_bar": False,
         "parallel.dp_replicate": 2}
    o.update(extra)
    return [f"--{k}={v}" for k, v in o.items()]


def _by_blocking_gather(v):
    """A moment whole through blocking c10d all_gathers of its local plain tensors (an 8-bit moment: its codes
    and its scales, each concatenated in shard order; shards hold whole 256-value blocks, so that order is the
    global block order). No functional collective and no torchao subclass dispatch (see the module note)."""
    local = v.to_local() if hasattr(v, "to_local") else v
    parts = (local.codes, local.scale) if hasattr(local, "codes") else (local,)
    if hasattr(v, "placements"):
        parts = tuple(_gathered(x, v.device_mesh, v.placements) for x in parts)
    return parts if hasattr(local, "codes") else parts[0]


def _gathered(x, mesh, placements):
    """x (this rank's piece, a plain tensor) concatenated along dim 0 over the one mesh dim that shards it
    (uneven pieces padded to the longest, then cut back)."""
    import torch
    import torch.distributed as dist

    shard_dims = [d for d, pl in enumerate(placements) if pl.is_shard()]
    assert len(shard_dims) <= 1 and all(placements[d].dim == 0 for d in shard_dims), placements
    for d in shard_dims:
        group = mesh.get_group(d)
        n = dist.get_world_size(group)
        rows = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(rows, torch.tensor([x.shape[0]]), group=group)
        rows = [int(r) for r in rows]
        padded = torch.zeros((max(rows), *x.shape[1:]), dtype=x.dtype)
        padded[:x.shape[0]] = x
        pieces = [torch.empty_like(padded) for _ in range(n)]
        dist.all_gather(pieces, padded, group=group)
        x = torch.cat([p[:r] for p, r in zip(pieces, rows)])
    return x


def _full_state(optimizer, model) -> dict:
    """name -> {param, exp_avg, exp_avg_sq} as whole tensors (an 8-bit moment: its codes and scales)."""
    out = {}
    for name, p in model.named_parameters():
        st = {"param": whole(p)}
        for k in ("exp_avg", "exp_avg_sq"):
            st[k] = _by_blocking_gather(optimizer.state[p][k])
        out[name] = st
    return out


def _identity(dtype: str) -> dict:
    """The same parameters and gradients, 5 steps, over 1, 2 and 4 shards: each layout's whole state."""
    import torch
    from torch.distributed.tensor import distribute_tensor

    from shardlm.build import build_model, build_model_config
    from shardlm.config import load_config
    from shardlm.parallel.dims import ParallelDims
    from shardlm.train.optim import build_optimizer

    cfg = load_config(None, ["--model.preset=debug", "--train.mixed_precision=fp32", "--train.lr=1e-2",
                             f"--train.optimizer_state_dtype={dtype}"])
    mc = build_model_config(cfg, 0)
    out = {}
    for shards in (1, 2, 4):
        mesh = ParallelDims(4 // shards, shards, 4).build_mesh("cpu")
        model = build_model(cfg, mc, mesh, torch.device("cpu"))
        opt = build_optimizer(model, cfg.train, torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        params = list(model.parameters())
        with torch.no_grad():
            for p in params:
                p.copy_(distribute_tensor(torch.randn(p.shape, generator=gen) * 0.05, p.device_mesh, p.placements))
        for _ in range(5):
            for p in params:
                p.grad = distribute_tensor(torch.randn(p.shape, generator=gen) * 1e-2, p.device_mesh, p.placements)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[shards] = _full_state(opt, model)
    return out


def _misaligned() -> str:
    """A vocabulary of 324 rows of 128 over 4 shards: 81 rows = 40.5 blocks per shard."""
    import torch

    from shardlm.build import build_model, build_model_config
    from shardlm.config import load_config
    from shardlm.errors import ConfigError
    from shardlm.parallel.dims import ParallelDims
    from shardlm.train.optim import build_optimizer

    cfg = load_config(None, ["--model.preset=debug", "--model.vocab_size=324", "--train.optimizer_state_dtype=int8"])
    model = build_model(cfg, build_model_config(cfg, 0), ParallelDims(1, 4, 4).build_mesh("cpu"), torch.device("cpu"))
    try:
        build_optimizer(model, cfg.train, torch.device("cpu"))
    except ConfigError as e:
        return str(e)
    return ""


def _train(runs: list[tuple[list[str], int | None]]) -> list[dict]:
    """Each (config, stop_after) in turn: losses, whole state, state bytes on this rank. `stop_after=k` stops
    after step k as SIGTERM does (save, stop)."""
    from shardlm.config import load_config
    from shardlm.train.optim import int8_quantised, state_bytes

    StopAfter = stop_after_trainer()

    out = []
    for overrides, stop_after in runs:
        StopAfter.stop_after = stop_after
        t = StopAfter(load_config(None, overrides))
        recs = t.train()
        shards = [(local(p).numel(), int8_quantised(p)) for p in t.model.parameters()]
        out.append({"loss": {r["step"]: r["loss"] for r in recs}, "start": recs[0]["step"] if recs else None,
                    "state": _full_state(t.optimizer, t.model), "bytes": state_bytes(t.optimizer),
                    "class": type(t.optimizer).__name__, "local": shards,
                    "resumed_from": t.optimizer.resumed_state_dtype,
                    "group_dtype": {g["state_dtype"] for g in t.optimizer.param_groups}})
        t.checkpointer.close()
        t.release_locks()
    return out


def _worker(tmp: str, corpus: str) -> dict:
    tmp = Path(tmp)
    cache = tmp / "cache"
    res = {"identity": {d: _identity(d) for d in ("bf16", "int8")}, "misaligned": _misaligned()}
    import torch

    # nothing left in flight in c10d's registry of unwaited collectives (functional ones: FSDP, torchao)
    res["unwaited"] = torch._C._distributed_c10d._get_work_registry_size()

    def run(name, dtype, stop=None, **kw):
        return _overrides(tmp / name, corpus, cache, dtype, **kw), stop

    for dtype in ("bf16", "int8"):
        half_ck = tmp / f"half_{dtype}" / "checkpoints" / f"step-{HALF}"
        over4 = {"checkpoint.resume": str(half_ck), "parallel.dp_replicate": 1}
        straight, half, resumed, to4, loaded4 = _train([
            run(f"straight_{dtype}", dtype), run(f"half_{dtype}", dtype, HALF), run(f"half_{dtype}", dtype),
            run(f"to4_{dtype}", dtype, **over4),
            run(f"loaded4_{dtype}", dtype, steps=HALF, **over4)])  # loads over 4 shards, nothing left to run
        res[dtype] = {"straight": straight, "half": half, "resumed": resumed, "to4": to4, "loaded4": loaded4}
    # FSDP2 CPU offload: the parameters and this state live on the CPU, the update runs there
    (res["int8_offload"],) = _train([run("int8_offload", "int8", **{"train.cpu_offload": "true"})])
    # fp32 moments saved at step 6, resumed with 8-bit ones: DCP quantises them into the int8 template
    fp32_ck = tmp / "fp32" / "checkpoints" / f"step-{HALF}"
    res["fp32"], res["fp32_to_int8"] = _train([run("fp32", "fp32", HALF),
                                               run("fp32_to_int8", "int8", **{"checkpoint.resume": str(fp32_ck)})])
    res["unwaited_at_end"] = torch._C._distributed_c10d._get_work_registry_size()
    return res


@pytest.fixture(scope="module")
def res(tmp_path_factory, corpus):
    return run_ranks(4, _worker, str(tmp_path_factory.mktemp("optim_state")), str(corpus))


def _assert_same_state(a: dict, b: dict, what: str) -> None:
    import torch

    assert a.keys() == b.keys()
    for name in a:
        for k, va in a[name].items():
            vb = b[name][k]
            pairs = zip(va, vb) if isinstance(va, tuple) else [(va, vb)]
            for x, y in pairs:
                assert torch.equal(x, y), f"{what}: {name}.{k} differs"


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_state_is_the_same_on_1_2_and_4_shards(res, dtype):
    import torch

    by_shards = res["identity"][dtype]
    some = next(iter(by_shards[1].values()))
    if dtype == "int8":  # the 8-bit moments really are 8-bit (not fp32 fallbacks) on every layout
        quantised = [n for n, st in by_shards[4].items() if isinstance(st["exp_avg"], tuple)]
        assert len(quantised) >= 0.8 * len(by_shards[4]) - 9, quantised  # all but the 9 norm weights
    else:
        assert some["exp_avg"].dtype == torch.bfloat16
    for shards in (2, 4):
        _assert_same_state(by_shards[1], by_shards[shards], f"{dtype}: 1 vs {shards} shards")


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_resume_is_exact(res, dtype):
    straight, resumed = res[dtype]["straight"], res[dtype]["resumed"]
    assert resumed["start"] == HALF + 1  # it really resumed
    for step in range(HALF + 1, STEPS + 1):
        assert resumed["loss"][step] == straight["loss"][step], step
    _assert_same_state(straight["state"], resumed["state"], f"{dtype} resume")


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_resume_on_more_shards_continues(res, dtype):
    straight, to4 = res[dtype]["straight"], res[dtype]["to4"]
    assert to4["start"] == HALF + 1
    for step in range(HALF + 1, STEPS + 1):
        assert to4["loss"][step] == pytest.approx(straight["loss"][step], rel=1e-5), step
    # saved over 2 shards, loaded over 4: the same parameters and moments (8-bit codes and scales), bit for bit
    assert res[dtype]["loaded4"]["start"] is None
    _assert_same_state(res[dtype]["half"]["state"], res[dtype]["loaded4"]["state"], f"{dtype} 2 -> 4 shards")


def test_state_bytes_per_rank(res):
    fp32, bf16, int8 = res["fp32"]["bytes"], res["bf16"]["straight"]["bytes"], res["int8"]["straight"]["bytes"]
    assert (res["fp32"]["class"], res["bf16"]["straight"]["class"], res["int8"]["straight"]["class"]) == \
        ("AdamW", "AdamWBF16State", "AdamWInt8State")
    local = res["fp32"]["local"]  # (values on this rank, 8-bit?) per parameter
    steps = 4 * len(local)  # a 4-byte step counter per parameter in every variant
    assert fp32 == steps + sum(8 * n for n, _ in local)
    assert bf16 == steps + sum(4 * n for n, _ in local)
    # an 8-bit moment: a uint8 code per value, an fp32 scale per 256 values, its 256-entry fp32 code table;
    # tensors under 4096 values (the norm weights) keep fp32 moments
    assert int8 == steps + sum(2 * (n + 4 * n // 256 + 1024) if q else 8 * n for n, q in local)
    assert 0.25 * fp32 < int8 < 0.28 * fp32, (int8, fp32)


def test_misaligned_shards_are_refused(res):
    msg = res["misaligned"]
    assert "embed_tokens.weight (324, 128)" in msg and "256-value" in msg and "optimizer_state_dtype=bf16" in msg, msg
    assert "\n" not in msg


def test_resume_from_fp32_state_converts(res):
    """A checkpoint with fp32 moments resumed under int8: the moments are quantised on load, the run goes on
    (losses within 1% of the int8 run that never stopped; seen: 2e-4), the optimizer says what it loaded."""
    run, straight = res["fp32_to_int8"], res["int8"]["straight"]
    assert run["start"] == HALF + 1 and run["class"] == "AdamWInt8State"
    assert run["resumed_from"] == "fp32" and run["group_dtype"] == {"int8"}
    assert isinstance(run["state"]["layers.0.mlp.up_proj.weight"]["exp_avg"], tuple)  # 8-bit again
    for step in range(HALF + 1, STEPS + 1):
        assert run["loss"][step] == pytest.approx(straight["loss"][step], rel=0.01), step
    assert res["int8"]["resumed"]["resumed_from"] == "int8"


def test_no_collective_is_left_unwaited(res):
    """After the identity runs and after every trainer run, c10d's registry of unwaited collectives is empty
    (reading torchao's 8-bit state through `full_tensor()` once left 1080 gathers in flight on rank 0)."""
    assert res["unwaited"] == 0 and res["unwaited_at_end"] == 0


def test_cpu_offload_gives_the_same_run(res):
    assert res["int8_offload"]["loss"] == res["int8"]["straight"]["loss"]
    _assert_same_state(res["int8_offload"]["state"], res["int8"]["straight"]["state"], "int8 with cpu_offload")
