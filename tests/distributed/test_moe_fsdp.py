"""Mixtures of experts under FSDP2 on real gloo groups (the debug_moe preset: 8 experts, top-2, 4 sparse layers).

The same runs on 1 rank, on dp_shard=2, and on dp_shard=4, HSDP 2x2 and dp_shard=2 x cp=2 over 4 ranks give the
same losses, gradient norms and load-balancing losses (fp32, rel 1e-5): the router statistics are summed over
every rank before the backward, so the balance loss is the global micro-batch's however the batch is split.
Cases: plain with grad_accum=2 and the z-loss on, and LoRA on attention and on the stacked experts under full
activation checkpointing. The experts
are sharded by expert (dim 0: 8 experts -> 4 per rank of 2); 3 experts over 4 ranks shard on another dim (each
stacked weight's largest) and still give one rank's losses. A run stopped at step 2 and resumed equals the
uninterrupted run, and the logged aux loss is the mean of HF's loss over the micro-batches (finite, > 1: top-k
picks are never perfectly balanced on a random model).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.launch import run_ranks
from helpers.whole import local

STEPS, REL = 4, 1e-5


@pytest.fixture(scope="module")
def store(tmp_path_factory, corpus):
    from helpers.stores import text_store

    from helpers.stores import sft_store

    d = tmp_path_factory.mktemp("moe_data")
    text = corpus.read_text()
    text_store([text[i : i + 400] for i in range(0, 60_000, 400)], d / "text", 0.05)
    # short samples (~38 tokens) one per row (data.pack=false): rows of 64 are 43% padding, all in the second half
    sft_store([{"prompt": f"{i}+{i}", "completion": f"={2 * i}"} for i in range(200)], d / "sft", 0.2)
    return d / "text"


def _args(tmp, tag, store, mbs, accum, **extra) -> list[str]:
    o = {"model.preset": "debug_moe", "model.router_aux_loss_coef": 0.02, "train.steps": STEPS,
         "train.output_dir": f"{tmp}/{tag}", "train.mixed_precision": "fp32", "train.micro_batch_size": mbs,
         "train.grad_accum": accum, "train.lr": 3e-3, "train.warmup_steps": 2, "data.seq_len": 64,
         "data.tokenizer": "bytes", "data.path": f"store:{store}", "metrics.log_every": 1,
         "metrics.progress_bar": False, "checkpoint.save_final": False, "train.sample_tokens": 0,
         "eval.interval": 0, "eval.at_end": True, "eval.max_tokens": 512}
    o.update(extra)
    if o.get("data.format") == "sft":
        o["data.path"] = f"store:{Path(store).parent / 'sft'}"
    return [f"--{k}={v}" for k, v in o.items()]


CASES = {  # name -> (grad_accum, overrides)
    "plain": (2, {"model.router_z_loss_coef": 0.001}),
    # + full activation checkpointing: the recomputed forward records the routing again (the same numbers)
    "lora": (1, {"lora.rank": 4, "lora.targets": "q_proj,v_proj,gate_proj,up_proj,down_proj", "train.ac": "full"}),
    # 3 experts over 4 ranks: fewer experts than ranks, so each stacked weight shards on its largest other dim
    "few": (1, {"model.n_experts": 3, "lora.rank": 4}),
    # SFT rows end in padding, which the router statistics leave out (a mask sliced like the tokens under CP)
    "sft": (1, {"data.format": "sft", "data.pack": "false"}),
}


def _runs(tmp, store, world_tag, mbs, names, **parallel):
    kw = {f"parallel.{k}": v for k, v in parallel.items()}
    return [(n, _args(tmp, f"{world_tag}_{n}", store, mbs, CASES[n][0], **CASES[n][1], **kw)) for n in names]


def train_runs(runs):
    from shardlm.config import load_config
    from shardlm.train.trainer import Trainer

    out = {}
    for tag, overrides in runs:
        t = Trainer(load_config(None, overrides))
        recs = t.train()
        experts = t.model.layers[0].mlp.experts
        out[tag] = {k: [r[k] for r in recs if k in r] for k in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss",
                                                                 "moe_load_max", "val_loss")}
        out[tag]["expert_rows"] = local(experts.gate_proj).shape[0]
        out[tag]["expert_shard"] = tuple(local(experts.gate_proj).shape), tuple(local(experts.down_proj).shape), \
            tuple(local(experts.lora_A["down_proj"]).shape) if experts.lora_A is not None else None
        out[tag]["trainable"] = sorted({n.split(".", 2)[-1] for n, p in t.model.named_parameters() if p.requires_grad})
        out[tag]["mark_padding"] = getattr(t.loader, "mark_padding", None)
        t.close()
    return out


def _two(tmp, store):
    from helpers.runs import train_then

    out = train_runs(_runs(tmp, store, "dp2", 1, CASES, dp_shard=2))
    straight = _args(tmp, "dp2_straight", store, 1, 1)
    half = _args(tmp, "dp2_half", store, 1, 1)
    resumed = _args(tmp, "dp2_resumed", store, 1, 1, **{"checkpoint.resume": f"{tmp}/dp2_half/checkpoints/step-2"})
    out["straight"], out["half"], out["resumed"] = train_then([(straight, None), (half, 2), (resumed, None)])
    return out


def _four(tmp, store):
    out = train_runs(_runs(tmp, store, "dp4", 1, ["plain"], dp_shard=4))
    out.update({f"hsdp_{k}": v for k, v in train_runs(_runs(tmp, store, "hsdp", 1, ["plain"], dp_replicate=2,
                                                            dp_shard=2)).items()})
    out.update({f"cp_{k}": v for k, v in train_runs(_runs(tmp, store, "cp", 1, ["lora", "sft"], dp_shard=2,
                                                            cp=2)).items()})
    out.update(train_runs(_runs(tmp, store, "dp4", 1, ["few"], dp_shard=4)))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory, store):
    tmp = tmp_path_factory.mktemp("moe_runs")
    # one rank: the 2-rank runs' global micro-batches (2 rows), and the 4-rank runs' (4 rows) for "plain"
    one = _runs(tmp, store, "one", 2, ["plain", "lora", "sft"]) + [("plain4", _runs(tmp, store, "one4", 4, ["plain"])[0][1])] \
        + _runs(tmp, store, "one", 4, ["few"])
    return {"one": run_ranks(1, train_runs, one),
            "two": run_ranks(2, _two, tmp, store),
            "four": run_ranks(4, _four, tmp, store)}


def _same(a, b, what, keys=("loss", "grad_norm", "moe_aux_loss", "val_loss")):
    for key in keys:
        assert len(a[key]) == len(b[key]) > 0, (what, key)
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            assert y == pytest.approx(x, rel=REL), f"{what}: {key}[{i}] {x} vs {y}"


@pytest.mark.parametrize("case", ["plain", "lora"])
def test_two_ranks_equal_one(results, case):
    one, two = results["one"][case], results["two"][case]
    _same(one, two, f"{case}: dp_shard=2 vs 1 rank")
    assert one["expert_rows"] == 8 and two["expert_rows"] == 4  # sharded by expert


def test_four_ranks_hsdp_and_cp_equal_one(results):
    one, four = results["one"], results["four"]
    _same(one["plain4"], four["plain"], "dp_shard=4", keys=("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"))
    _same(one["plain4"], four["hsdp_plain"], "HSDP 2x2", keys=("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"))
    _same(one["lora"], four["cp_lora"], "dp_shard=2 x cp=2 (LoRA)")
    _same(one["sft"], four["cp_sft"], "dp_shard=2 x cp=2 (SFT, padding out of the router statistics)")
    assert one["sft"]["mark_padding"] is True and four["cp_sft"]["mark_padding"] is True
    assert one["plain"]["mark_padding"] is None  # text rows: no padding to mark
    assert four["plain"]["expert_rows"] == 2 and four["hsdp_plain"]["expert_rows"] == 4


def test_fewer_experts_than_ranks_shard_each_expert_on_another_dim(results):
    one, four = results["one"]["few"], results["four"]["few"]
    _same(one, four, "3 experts over dp_shard=4")
    # gate_proj (3, 48, 128): dim 2 (128) over 4 ranks; down_proj (3, 128, 48): dim 1; LoRA A (3, 4, 48): dim 2
    assert one["expert_shard"] == ((3, 48, 128), (3, 128, 48), (3, 4, 48))
    assert four["expert_shard"] == ((3, 48, 32), (3, 32, 48), (3, 4, 12)), four["expert_shard"]


def test_the_balance_losses_are_logged_and_lora_trains_the_experts(results):
    plain, lora = results["one"]["plain"], results["one"]["lora"]
    assert len(plain["moe_aux_loss"]) == STEPS and all(1.0 < a < 8.0 for a in plain["moe_aux_loss"])
    assert len(plain["moe_z_loss"]) == STEPS and all(z > 0 for z in plain["moe_z_loss"])
    assert "moe_z_loss" not in lora or not lora["moe_z_loss"]  # off unless its coefficient is set
    assert all(m >= 1.0 for m in plain["moe_load_max"])
    assert {"mlp.experts.lora_A.gate_proj", "mlp.experts.lora_B.down_proj", "self_attn.q_proj.lora_A.weight"} <= \
        set(lora["trainable"])
    assert not any(t.endswith(("experts.gate_proj", "mlp.gate.weight")) for t in lora["trainable"])  # frozen base


def test_resume_is_exact(results):
    two = results["two"]
    straight, resumed = two["straight"], two["resumed"]
    assert resumed["start"] == 3
    for step in (3, 4):
        assert resumed["loss"][step] == pytest.approx(straight["loss"][step], rel=REL), step
    assert resumed["weights"] == pytest.approx(straight["weights"], rel=1e-6)
