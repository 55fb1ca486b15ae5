"""`train.compile` on 2 gloo ranks: each FSDP2-sharded block runs compiled, with eager's losses.

`aot_eager` (dynamo + AOTAutograd, no code generation) checks the parts that can break under FSDP2:
tracing the block with its sharded-then-unsharded parameters, FSDP's hooks left outside the graph,
activation checkpointing inside it, no graph breaks, and one graph shared by all blocks (no
recompilation per block, which would hit dynamo's recompile limit on an 80-layer model and fall
back to eager). Its losses equal eager's to the last bit. `inductor` (the default backend, C++ code
generation on CPU, Triton on GPUs) is run once on a 2-block model: fused kernels reorder fp32
arithmetic, so its losses match within 1e-5.
"""

from __future__ import annotations

import pytest
from helpers.launch import run_ranks

STEPS = 4


def _overrides(tmp, corpus, tag, n_layers, **extra):
    o = {"model.preset": "debug", "model.n_layers": n_layers, "train.steps": STEPS, "train.output_dir": f"{tmp}/{tag}",
         "train.micro_batch_size": 2, "train.lr": 3e-3, "train.warmup_steps": 2, "data.path": str(corpus),
         "data.seq_len": 64, "data.cache_dir": f"{tmp}/cache", "metrics.log_every": 1,
         "metrics.progress_bar": False, "checkpoint.save_final": False, "train.mixed_precision": "fp32"}
    o.update(extra)
    return [f"--{k}={v}" for k, v in o.items()]


def compile_runs(runs: dict[str, list[str]]) -> dict[str, dict]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    from shardlm.config import load_config
    from shardlm.train.trainer import Trainer

    out = {}
    for tag, overrides in runs.items():
        torch._dynamo.reset()
        counters.clear()
        t = Trainer(load_config(None, overrides))
        recs = t.train()
        out[tag] = {
            "loss": [r["loss"] for r in recs],
            "names": sorted(n for n, _ in t.model.named_parameters()),
            "compiled_blocks": sum(getattr(b, "_compiled_call_impl", None) is not None for b in t.model.layers),
            "unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": dict(counters["graph_break"]),
            "aot_ok": counters["aot_autograd"]["ok"],
        }
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("compile")
    aot = {"train.compile": True, "train.compile_backend": "aot_eager"}
    runs = {
        "eager": _overrides(tmp, corpus, "eager", 4),
        "aot_eager": _overrides(tmp, corpus, "aot", 4, **aot),
        "eager_ac": _overrides(tmp, corpus, "eager_ac", 4, **{"train.ac": "full"}),
        "aot_eager_ac": _overrides(tmp, corpus, "aot_ac", 4, **aot, **{"train.ac": "full"}),
        "eager_2": _overrides(tmp, corpus, "eager_2", 2),
        "inductor_2": _overrides(tmp, corpus, "inductor_2", 2, **{"train.compile": True}),
    }
    return run_ranks(2, compile_runs, runs)


@pytest.mark.parametrize("tag", ["aot_eager", "aot_eager_ac"])
def test_compiled_blocks_match_eager_bitwise(results, tag):
    r, e = results[tag], results[tag.replace("aot_eager", "eager")]
    assert r["compiled_blocks"] == 4 and e["compiled_blocks"] == 0
    assert r["aot_ok"] >= 1  # forward and backward went through AOTAutograd
    assert r["unique_graphs"] == 1, r  # one graph for all four blocks: no per-block recompilation
    assert r["graph_breaks"] == {}, r["graph_breaks"]
    assert r["loss"] == e["loss"]
    assert r["names"] == e["names"]  # no `_orig_mod.` in parameter (and checkpoint) names


def test_inductor_matches_eager(results):
    r, e = results["inductor_2"], results["eager_2"]
    assert r["compiled_blocks"] == 2 and r["graph_breaks"] == {}
    assert len(r["loss"]) == STEPS
    assert r["loss"] == pytest.approx(e["loss"], rel=1e-5)
    assert r["loss"][-1] < r["loss"][0]


def test_unknown_backend_is_a_config_error():
    import torch

    from shardlm.errors import ConfigError
    from shardlm.models import ModelConfig, Transformer
    from shardlm.parallel.compile import apply_compile

    with torch.device("meta"):
        model = Transformer(ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=32))
    with pytest.raises(ConfigError, match="train.compile_backend='nope' is not a torch.compile backend"):
        apply_compile(model, "nope")
