"""parallel.cp (Ulysses context parallelism) on real gloo groups: the same runs on 1 rank, on cp=2 over 2 ranks,
and on dp_shard=2 x cp=2 and cp=4 over 4 ranks give the same losses, gradient norms and validation losses
(fp32, rel 1e-5): text rows, document-masked packed rows (positions restart per document across the slice
boundary), LoRA, SFT answer masks, chunked cross-entropy. cp=4 on a model with 2 KV heads repeats them (the
exchange's other path). Each rank of a CP group holds its slice of the tokens, and FSDP shards the parameters
over dp_shard x cp (the local shard sizes say so).
"""

from __future__ import annotations


import pytest
from helpers.launch import run_ranks
from helpers.whole import local

STEPS, REL = 4, 1e-5


@pytest.fixture(scope="module")
def stores(tmp_path_factory, corpus):
    from helpers.stores import sft_store, text_store

    d = tmp_path_factory.mktemp("cp_data")
    text = corpus.read_text()
    text_store([text[i : i + 150 + (i % 7) * 20] for i in range(0, 80_000, 300)], d / "text", 0.05)  # short docs
    sft_store([{"prompt": f"what is {i} plus {i}?", "completion": f"{i} plus {i} is {2 * i}."} for i in range(200)],
              d / "sft", 0.2)
    return d


def _args(tmp, tag, store, mbs, **extra) -> list[str]:
    o = {"model.preset": "debug", "train.steps": STEPS, "train.output_dir": f"{tmp}/{tag}",
         "train.mixed_precision": "fp32", "train.micro_batch_size": mbs, "train.lr": 3e-3, "train.warmup_steps": 2,
         "data.seq_len": 64, "data.tokenizer": "bytes", "data.path": f"store:{store}", "metrics.log_every": 1,
         "metrics.progress_bar": False, "checkpoint.save_final": False, "train.sample_tokens": 0,
         "eval.interval": 0, "eval.at_end": True, "eval.max_tokens": 512}
    o.update(extra)
    return [f"--{k}={v}" for k, v in o.items()]


CASES = {  # name -> (store, extra overrides)
    "text": ("text", {}),
    "docs": ("text", {"data.document_mask": "true"}),
    "lora": ("text", {"lora.rank": 4, "data.document_mask": "true"}),
    "sft": ("sft", {"data.format": "sft", "data.seq_len": 48}),
    "chunked": ("text", {"train.loss_chunk_tokens": 16}),
}


def _runs(tmp, stores, world_tag: str, mbs: int, names, **parallel) -> list[tuple[str, list[str]]]:
    out = []
    for name in names:
        store, extra = CASES[name]
        kw = {f"parallel.{k}": v for k, v in parallel.items()}
        out.append((name, _args(tmp, f"{world_tag}_{name}", stores / store, mbs, **extra, **kw)))
    return out


def train_runs(runs: list[tuple[str, list[str]]]) -> dict[str, dict]:
    from shardlm.config import load_config
    from shardlm.train.trainer import Trainer

    out = {}
    for tag, overrides in runs:
        t = Trainer(load_config(None, overrides))
        recs = t.train()
        cp = t.model.context_parallel
        out[tag] = {"loss": [r["loss"] for r in recs], "grad_norm": [r["grad_norm"] for r in recs],
                    "val": [r["val_loss"] for r in recs if "val_loss" in r],
                    "cp": None if cp is None else (cp.size, cp.kv_repeat),
                    "describe": None if cp is None else cp.describe(t.model_cfg.n_heads, t.model_cfg.n_kv_heads),
                    "embed_rows": local(t.model.embed_tokens.weight).shape[0], "mesh": t.mesh.mesh_dim_names}
        t.close()
    return out


def _refused(overrides: list[str]) -> str:
    from shardlm.config import load_config
    from shardlm.errors import ConfigError
    from shardlm.train.trainer import Trainer

    try:
        Trainer(load_config(None, overrides)).close()
    except ConfigError as e:
        return str(e)
    return ""


def _four(tmp, stores):
    out = train_runs(_runs(tmp, stores, "dp2cp2", 1, ["text", "docs"], dp_shard=2, cp=2))
    out.update({f"cp4_{k}": v for k, v in train_runs(_runs(tmp, stores, "cp4", 2, ["docs"], cp=4)).items()})
    return out


def _two(tmp, stores):
    from helpers.runs import train_then

    out = train_runs(_runs(tmp, stores, "cp2", 2, CASES, cp=2))
    out["refused"] = _refused(_args(tmp, "odd", stores / "text", 2, **{"data.seq_len": 63, "parallel.cp": 2}))
    # saved by a cp=2 run at step 2, resumed by plain FSDP over the same 2 ranks (dp 2, the same global batch)
    half = _args(tmp, "cp2_half", stores / "text", 2, **{"parallel.cp": 2})
    resumed = _args(tmp, "cp2_resumed", stores / "text", 1, **{
        "parallel.cp": 1, "checkpoint.resume": f"{tmp}/cp2_half/checkpoints/step-2"})
    out["half"], out["resumed"] = train_then([(half, 2), (resumed, None)])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory, stores):
    tmp = tmp_path_factory.mktemp("cp_runs")
    return {"one": run_ranks(1, train_runs, _runs(tmp, stores, "one", 2, CASES)),
            "two": run_ranks(2, _two, tmp, stores),
            "four": run_ranks(4, _four, tmp, stores)}


def _same(a: dict, b: dict, what: str) -> None:
    for key in ("loss", "grad_norm", "val"):
        assert len(a[key]) == len(b[key]) > 0, (what, key)
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            assert y == pytest.approx(x, rel=REL), f"{what}: {key}[{i}] {x} vs {y}"


@pytest.mark.parametrize("case", list(CASES))
def test_cp2_on_2_ranks_equals_one_rank(results, case):
    one, two = results["one"][case], results["two"][case]
    assert one["cp"] is None and two["cp"] == (2, 1)
    assert two["mesh"] == ("dp_shard", "cp")
    _same(one, two, f"{case}: cp=2 vs 1 rank")
    # the parameters are sharded over dp_shard x cp = 2 ranks: CP costs no parameter memory
    assert two["embed_rows"] == one["embed_rows"] // 2


@pytest.mark.parametrize("case", ["text", "docs"])
def test_dp_shard_2_x_cp_2_equals_one_rank(results, case):
    four = results["four"][case]
    assert four["cp"] == (2, 1) and four["mesh"] == ("dp_shard", "cp")
    _same(results["one"][case], four, f"{case}: dp_shard=2 x cp=2 vs 1 rank")
    assert four["embed_rows"] == results["one"][case]["embed_rows"] // 4


def test_cp4_repeats_the_kv_heads_and_equals_one_rank(results):
    four = results["four"]["cp4_docs"]
    assert four["cp"] == (4, 2)  # 2 KV heads cannot be split 4 ways: repeated to the 4 query heads
    assert "1 of 4 query and 1 KV heads (the 2 KV heads repeated to 4" in four["describe"], four["describe"]
    assert "Ulysses" in results["two"]["text"]["describe"] and "2 of 4 query and 1 KV heads" in \
        results["two"]["text"]["describe"]
    _same(results["one"]["docs"], four, "docs: cp=4 vs 1 rank")


def test_a_row_length_cp_does_not_divide_is_one_line(results):
    msg = results["two"]["refused"]
    assert "parallel.cp=2" in msg and "data.seq_len=63" in msg and "multiple of 2" in msg, msg
    assert "\n" not in msg


def test_a_cp_checkpoint_resumes_without_cp(results):
    """Checkpoints and the sample order do not depend on parallel.cp: saved under cp=2, resumed by dp=2."""
    straight, resumed = results["two"]["text"], results["two"]["resumed"]
    assert resumed["start"] == 3
    for step in range(3, STEPS + 1):
        assert resumed["loss"][step] == pytest.approx(straight["loss"][step - 1], rel=REL), step
