"""Precision policies on 2 gloo ranks: bf16 and FP8 (torchao, emulated on CPU) track the fp32 curve;
the FP8 run really uses float8 linears and their scaled matmuls; CPU offload keeps the fp32 losses
and leaves the parameters on the CPU."""

from __future__ import annotations

import pytest
from helpers.launch import run_ranks

STEPS = 10


def _overrides(tmp, corpus, tag, **extra):
    o = {"model.preset": "debug", "train.steps": STEPS, "train.output_dir": f"{tmp}/{tag}",
         "train.micro_batch_size": 2, "train.lr": 3e-3, "train.warmup_steps": 3, "data.path": str(corpus),
         "data.seq_len": 64, "data.cache_dir": f"{tmp}/cache", "metrics.log_every": 1,
         "metrics.progress_bar": False, "checkpoint.save_final": False}
    o.update(extra)
    return [f"--{k}={v}" for k, v in o.items()]


def precision_runs(runs: dict[str, list[str]]) -> dict[str, dict]:
    import torch
    from torch.distributed.tensor import DTensor

    from shardlm.config import load_config
    from shardlm.train.trainer import Trainer

    calls = {"mm": 0}
    try:
        from torchao.float8 import float8_ops

        for op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            real = float8_ops.FLOAT8_OPS_TABLE[op]

            def counted(aten_op, args, kwargs=None, _real=real):
                calls["mm"] += 1
                return _real(aten_op, args, kwargs)

            float8_ops.FLOAT8_OPS_TABLE[op] = counted
    except ImportError:
        pass
    out = {}
    for tag, overrides in runs.items():
        calls["mm"] = 0
        t = Trainer(load_config(None, overrides))
        recs = t.train()
        kinds = {type(m).__name__ for m in t.model.modules()}
        n_fp8 = sum(type(m).__name__ == "Float8Linear" for m in t.model.modules())
        devices = {p.to_local().device.type if isinstance(p, DTensor) else p.device.type
                   for p in t.model.parameters()}
        out[tag] = {"loss": [r["loss"] for r in recs], "n_fp8": n_fp8, "fp8_mm_calls": calls["mm"],
                    "kinds": sorted(kinds), "param_devices": sorted(devices)}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("prec")
    runs = {"fp32": _overrides(tmp, corpus, "fp32", **{"train.mixed_precision": "fp32"}),
            "bf16": _overrides(tmp, corpus, "bf16", **{"train.mixed_precision": "bf16"}),
            "offload": _overrides(tmp, corpus, "offload", **{"train.mixed_precision": "fp32",
                                                             "train.cpu_offload": True})}
    try:
        import torchao  # noqa: F401

        for recipe in ("tensorwise", "rowwise"):
            runs[f"fp8_{recipe}"] = _overrides(tmp, corpus, f"fp8_{recipe}", **{
                "train.mixed_precision": "fp8", "train.fp8_recipe": recipe, "train.fp8_emulate": True})
    except ImportError:
        pass
    return run_ranks(2, precision_runs, runs)


def _max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_bf16_tracks_fp32(results):
    assert _max_rel(results["bf16"]["loss"], results["fp32"]["loss"]) < 0.02
    assert results["bf16"]["loss"] != results["fp32"]["loss"]  # it really ran in bf16


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_tracks_fp32_with_float8_linears(results, recipe):
    pytest.importorskip("torchao")
    r = results[f"fp8_{recipe}"]
    assert r["n_fp8"] == 7 * 4  # every projection of the 4 blocks; lm_head stays bf16
    assert r["fp8_mm_calls"] >= STEPS * 28 * 3  # forward + 2 backward matmuls per layer per step
    assert _max_rel(r["loss"], results["fp32"]["loss"]) < 0.05
    assert r["loss"][-1] < r["loss"][0] - 0.5


def test_cpu_offload_same_losses_params_on_cpu(results):
    assert _max_rel(results["offload"]["loss"], results["fp32"]["loss"]) < 1e-5
    assert results["offload"]["param_devices"] == ["cpu"]


def test_fp8_without_fp8_hardware_is_a_clear_error(tmp_path, corpus):
    pytest.importorskip("torchao")
    import torch

    from shardlm.errors import ConfigError
    from shardlm.quant.fp8 import check_fp8_hardware

    with pytest.raises(ConfigError, match="needs FP8 matmuls .* set train.fp8_emulate=true"):
        check_fp8_hardware(torch.device("cpu"), emulate=False)
    check_fp8_hardware(torch.device("cpu"), emulate=True)
