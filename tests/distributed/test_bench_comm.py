"""`shardlm bench comm`: nccl-tests' definitions, the step estimate, the traffic model against the bytes FSDP2
really sends (4 gloo ranks, 2x2), and the command itself under torchrun on 4 ranks with a 2x2 mesh."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.launch import run_ranks

from shardlm.bench.comm import (
    ModelBytes,
    Traffic,
    _flag_line,
    bus_factor,
    estimate_step,
    flag_slow_dims,
    parse_size,
    step_traffic,
    sweep_sizes,
)
from shardlm.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug.toml")
MIB = 2**20


# -- unit: definitions and the pure estimate ---------------------------------------------------------

def test_busbw_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8 and bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_gather", 8) == bus_factor("reduce_scatter", 8) == 7 / 8
    assert bus_factor("all_gather", 2) == 0.5
    with pytest.raises(ValueError):
        bus_factor("broadcast", 8)


def test_sizes():
    assert [parse_size(s) for s in ("1MiB", "4M", "1MB", "512KiB", "1GiB", "1048576", "1.5 KiB")] == \
        [MIB, 4 * MIB, 10**6, 512 * 1024, 2**30, MIB, 1536]
    for bad in ("abc", "0", "-1MiB", "1XB"):
        with pytest.raises(ConfigError, match="bad size"):
            parse_size(bad)
    assert sweep_sizes(64 * MIB) == [MIB, 4 * MIB, 16 * MIB, 64 * MIB]
    assert sweep_sizes(2**30) == [MIB * 4**k for k in range(6)]
    assert sweep_sizes(3 * MIB) == [MIB, 3 * MIB]


MB = ModelBytes(n_blocks=4, block_params=100, block_trainable=100, root_params=50, root_trainable=50,
                param_size=2, grad_size=4)


def _bytes(t: Traffic) -> tuple[int, int, int]:
    return t.all_gather, t.reduce_scatter, t.all_reduce


def test_step_traffic():
    # HSDP 2 x 4, grad_accum 3, reduce per micro-batch: per micro-batch 4 fwd + 3 bwd blocks + root once
    # (bf16; the root stays unsharded to backward), reduce-scatter of every grad (fp32) 3 times, all-reduce of
    # the shards once.
    assert _bytes(step_traffic(MB, 4, 2, True, 3, "micro_batch")) == \
        ((7 * 100 + 50) * 2 * 3, 450 * 4 * 3, 1800 // 4)
    assert _bytes(step_traffic(MB, 4, 2, True, 3, "step"))[1] == 1800
    assert _bytes(step_traffic(MB, 4, 1, False, 3, "micro_batch")) == ((4 * 100 + 50) * 2 * 3, 1800 * 3, 0)
    assert _bytes(step_traffic(MB, 1, 8)) == (0, 0, 1800)  # no sharding: plain replication
    # the last 2 blocks kept unsharded (an integer, or auto with room for 1 more block of 200 bytes at the peak)
    two = ((6 * 100 + 50) * 2, 1800, 0)
    assert _bytes(step_traffic(MB, 4, 1, 2)) == two
    assert _bytes(step_traffic(MB, 4, 1, "auto", spare_bytes=399)) == two
    assert _bytes(step_traffic(MB, 4, 1, "auto")) == _bytes(step_traffic(MB, 4, 1, True))  # no GPU: as true
    lora = ModelBytes(4, 100, 10, 50, 0, 2, 4)  # frozen weights are gathered, only the adapters reduced
    assert _bytes(step_traffic(lora, 4, 1)) == ((7 * 100 + 50) * 2, 40 * 4, 0)


def test_estimate_step():
    e = estimate_step(Traffic(10**9, 5 * 10**8, 0, {}), {"all_gather": 1e10, "reduce_scatter": 5e9}, 6e12, 1e13)
    assert e.comm_s == {"all_gather": 0.1, "reduce_scatter": 0.1, "all_reduce": 0.0} and not e.missing
    assert e.total_comm_s == pytest.approx(0.2) and e.compute_s == pytest.approx(0.6)
    assert e.fraction == pytest.approx(0.25)
    e = estimate_step(Traffic(10**9, 0, 10**6, {}), {"all_gather": 1e10, "all_reduce": None}, 1e12, 1e13)
    assert e.missing == ["all_reduce"] and e.total_comm_s == pytest.approx(0.1)


def test_flag_slow_dims():
    assert flag_slow_dims({"dp_replicate": 100.0, "dp_shard": 800.0}) == [("dp_replicate", "dp_shard", 0.125)]
    assert flag_slow_dims({"dp_replicate": 100.0, "dp_shard": 800.0}, ratio=0.1) == []
    assert flag_slow_dims({"dp_replicate": 700.0, "dp_shard": 800.0}) == []
    assert flag_slow_dims({"dp_shard": 800.0}) == []
    line = _flag_line("dp_shard", "dp_replicate", 0.125, {"dp_shard": 100.0, "dp_replicate": 800.0}, 0.25)
    assert line.startswith("flag: dp_shard busbw 100.00 GB/s is 0.12x dp_replicate's 800.00 GB/s")
    assert "NVLink domain" in line and "parallel.dp_replicate" in line


# -- distributed: the traffic model == what FSDP2 sends ----------------------------------------------

def _count_traffic(configs: list[list[str]]) -> list[tuple[dict, tuple]]:
    """Per config: the bytes each collective moved in one forward_backward (counted by wrapping the
    torch.distributed functions FSDP2 calls) and step_traffic's numbers."""
    import torch
    import torch.distributed as dist

    from shardlm.bench.comm import model_bytes
    from shardlm.build import build_model, build_model_config
    from shardlm.config import load_config
    from shardlm.distributed.env import init_distributed
    from shardlm.parallel.dims import ParallelDims
    from shardlm.train.step import forward_backward

    env = init_distributed("cpu")
    dims = ParallelDims(2, 2, env.world_size)
    mesh = dims.build_mesh("cpu")
    seen, depth = {}, [0]

    def wrap(name: str, kind: str, pos: int, kws: tuple[str, ...]) -> None:
        orig = getattr(dist, name, None)
        if orig is None:
            return

        def counted(*a, **k):
            if depth[0] == 0:  # the deprecated names call the new ones: count the outer call only
                t = next((k[x] for x in kws if x in k), None)
                t = a[pos] if t is None else t
                seen[kind] += t.numel() * t.element_size()
            depth[0] += 1
            try:
                return orig(*a, **k)
            finally:
                depth[0] -= 1
        setattr(dist, name, counted)

    for name in ("all_gather_single", "all_gather_into_tensor"):
        wrap(name, "all_gather", 0, ("output_tensor", "output"))
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        wrap(name, "reduce_scatter", 1, ("input", "input_tensor"))
    wrap("all_reduce", "all_reduce", 0, ("tensor",))
    out = []
    for overrides in configs:
        cfg = load_config(DEBUG, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", *overrides])
        mc = build_model_config(cfg, 0)
        model = build_model(cfg, mc, mesh, env.device)
        x = torch.randint(0, 256, (2, 16))
        seen.update(all_gather=0, reduce_scatter=0, all_reduce=0)
        forward_backward(model, [(x, x)] * cfg.train.grad_accum, 1.0, env.device, cfg.train.grad_sync, dims.hsdp)
        t = step_traffic(model_bytes(cfg, mc, "cpu")[0], 2, 2, cfg.parallel.reshard_after_forward,
                         cfg.train.grad_accum, cfg.train.grad_sync)
        out.append((dict(seen), _bytes(t)))
        del model
    return out


def _traffic_and_cp(configs: list[list[str]]) -> tuple[list, list[dict]]:
    """_count_traffic, then `measure_mesh` over a dp_shard=2 x cp=2 mesh (parallel.cp's all-to-all)."""
    import torch

    from shardlm.bench.comm import measure_mesh
    from shardlm.parallel.dims import ParallelDims

    traffic = _count_traffic(configs)
    mesh = ParallelDims(1, 2, 4, cp=2).build_mesh("cpu")
    fsdp = {c: ("fsdp", MIB, "fp32") for c in ("all_gather", "reduce_scatter", "all_reduce")}
    fsdp["all_to_all"] = ("cp: one layer", MIB, "fp32")
    rows, dims = measure_mesh(mesh, fsdp, [2 * MIB], torch.device("cpu"), 2, 1)
    return traffic, rows


CONFIGS = [["--train.grad_accum=2"],  # reduce-scatter per micro-batch, all-reduce once; the root gathered once
           ["--train.grad_accum=2", "--train.grad_sync=step", "--parallel.reshard_after_forward=false",
            "--lora.rank=4"]]  # LoRA: frozen weights gathered, adapters reduced


@pytest.fixture(scope="module")
def results():
    return run_ranks(4, _traffic_and_cp, CONFIGS)


def test_traffic_model_matches_fsdp2_and_cp_measures_its_all_to_all(results):
    traffic, rows = results
    for overrides, (seen, model) in zip(CONFIGS, traffic):
        assert (seen["all_gather"], seen["reduce_scatter"], seen["all_reduce"]) == model, overrides
    # the cp dimension runs the all-to-all only (at its layer size and the sweep), the dp_shard one FSDP's three
    assert {(r["dim"], r["collective"]) for r in rows} == {("cp", "all_to_all"), ("dp_shard", "all_gather"),
                                                          ("dp_shard", "reduce_scatter"), ("dp_shard", "all_reduce")}
    cp = [r for r in rows if r["dim"] == "cp"]
    assert [r["label"] for r in cp] == ["cp: one layer", "sweep"] and [r["size_bytes"] for r in cp] == [MIB, 2 * MIB]
    assert all(r["error"] is None and r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] / 2) for r in cp), cp


# -- the command under torchrun ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> tuple[subprocess.CompletedProcess, str]:
    d = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                        "-m", "shardlm", "bench", "comm", "--config", DEBUG, "--parallel.dp_replicate=2",
                        "--parallel.dp_shard=2", "--sizes", "1MiB,2MiB", "--iters", "2", "--warmup", "1", "--json",
                        "--save", str(d / "out" / "bench.txt")],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return p, (d / "out" / "bench.txt").read_text()


def test_json_has_busbw_for_both_dims_and_all_collectives(four_ranks):
    rep = json.loads(four_ranks[0].stdout)
    assert rep["world_size"] == 4 and rep["mesh"] == {"dp_replicate": 2, "dp_shard": 2, "cp": 1}
    for dim in ("dp_replicate", "dp_shard"):
        for c in ("all_gather", "reduce_scatter", "all_reduce"):
            rows = [r for r in rep["results"] if r["dim"] == dim and r["collective"] == c]
            assert [r["label"] == "sweep" for r in rows] == [False, True, True], rows
            assert all(r["busbw_gbps"] > 0 and r["error"] is None for r in rows), rows
            r = rows[1]
            assert r["size_bytes"] == MIB and r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * bus_factor(c, 2))
    assert rep["fsdp_sizes"]["all_gather"] == 196_864 * 4  # one debug block, fp32 on CPU
    e = rep["step_estimate"]
    assert e["total_comm_ms"] > 0 and e["compute_ms"] > 0 and 0 < e["comm_fraction"] < 1 and not e["missing"]


def test_text_report_prints_busbw_for_both_dims(four_ranks):
    text = four_ranks[1]
    assert "mesh dp_replicate=2 x dp_shard=2" in text
    busbw, dim, coll = {}, None, None
    for line in text.splitlines():
        if m := re.match(r"(dp_\w+): 2 ranks per group", line):
            dim = m.group(1)
        elif m := re.match(r"  (\w+) \(", line):
            coll = m.group(1)
        elif re.match(r" {4} *\d+ ", line) and dim:
            busbw.setdefault((dim, coll), []).append(float(line.split()[5]))
        elif not line:
            dim = None
    assert sorted(busbw) == [(d, c) for d in ("dp_replicate", "dp_shard")
                             for c in ("all_gather", "all_reduce", "reduce_scatter")]
    assert all(len(v) == 3 and min(v) > 0 for v in busbw.values()), busbw
    assert re.search(r"comm / \(comm \+ compute\) = 0\.\d\d", text)
    assert "flags: none" in text
