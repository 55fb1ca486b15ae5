"""Validation in the loop: val_loss is a sum over every target token of one fixed set divided by their count, so it
is the same on 1 rank, 2 ranks and 2x2 HSDP (text, SFT answer masks, document masks); it equals a hand
computation over the validation tokens; training losses are identical with evaluation on and off. The same runs
check the profiler (a parseable trace per rank) and W&B offline (a run folder holding the scalars)."""

from __future__ import annotations

import gzip
import json
import math
import os

import numpy as np
import pytest

from helpers.launch import run_ranks

STEPS, REL = 6, 1e-5


def _records(n: int) -> list[dict]:
    return [{"prompt": f"what is {i} plus {i}?", "completion": f"{i} plus {i} is {2 * i}."} for i in range(n)]


@pytest.fixture(scope="module")
def stores(tmp_path_factory, corpus):
    from helpers.stores import sft_store, text_store

    d = tmp_path_factory.mktemp("val")
    text = corpus.read_text()
    docs = [text[i : i + 400] for i in range(0, 160_000, 400)]
    text_store(docs, d / "text", 0.05)
    # a second source for a mixture: other documents, its own validation split
    text_store([t[::-1] for t in docs[:200]], d / "text_b", 0.1)
    sft_store(_records(300), d / "sft", 0.2)
    return d


def _args(tmp, tag, store, **extra) -> list[str]:
    o = {"model.preset": "debug", "train.steps": STEPS, "train.output_dir": f"{tmp}/{tag}",
         "train.mixed_precision": "fp32", "train.micro_batch_size": 2, "train.grad_accum": 1, "train.lr": 3e-3,
         "train.warmup_steps": 2, "data.seq_len": 64, "data.tokenizer": "bytes", "data.path": f"store:{store}",
         "metrics.log_every": 1, "metrics.progress_bar": False, "checkpoint.save_final": False,
         "train.sample_tokens": 0, "eval.interval": 3}
    o.update(extra)
    return [f"--{k}={v}" for k, v in o.items()]


def train_runs(runs: list[tuple[str, list[str], bool]]) -> dict[str, dict]:
    """Each (tag, overrides, hand) trained in turn: its losses, its metrics.jsonl validation records, and with
    `hand` the validation loss computed by hand over the store's val/ windows with the final model."""
    import torch
    import torch.nn.functional as F

    from shardlm.config import load_config
    from shardlm.train.trainer import Trainer

    out = {}
    for tag, overrides, hand in runs:
        t = Trainer(load_config(None, overrides))
        recs = t.train()
        r = {"loss": [x["loss"] for x in recs], "val": [(x["step"], x["val_loss"]) for x in recs if "val_loss" in x],
             "bpb": [x.get("val_bpb") for x in recs if "val_loss" in x], "best": t.best_val,
             "keys": sorted(recs[-1]), "last_val": ([x for x in recs if "val_loss" in x] or [None])[-1]}
        if t.validator is not None:
            r["val_rows"] = t.validator.n_rows
        if hand:  # world 1: the FSDP model holds every weight; plain CE over every window of val/
            L = t.cfg.data.seq_len
            tokens = np.memmap(t.val_store.path / "tokens.bin", dtype=np.uint16, mode="r").astype(np.int64)
            n = (len(tokens) - 1) // L
            total, count = 0.0, 0
            t.model.eval()
            with torch.no_grad():
                for w in range(n):
                    x = torch.from_numpy(tokens[w * L : w * L + L + 1]).unsqueeze(0)
                    logits = t.model(x[:, :-1])
                    total += float(F.cross_entropy(logits.float()[0], x[0, 1:], reduction="sum"))
                    count += L
            r["hand"] = total / count
        out[tag] = r
        t.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory, stores):
    tmp = tmp_path_factory.mktemp("valruns")
    text, sft = stores / "text", stores / "sft"
    sft_kw = {"data.format": "sft", "data.seq_len": 48}
    docs_kw = {"data.document_mask": "true"}
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    one = run_ranks(1, train_runs, [
        ("text1", _args(tmp, "text1", text, **{"train.grad_accum": 2, "metrics.wandb": "true"}), True),
        ("sft1", _args(tmp, "sft1", sft, **sft_kw, **{"train.grad_accum": 2}), False),
        ("docs1", _args(tmp, "docs1", text, **docs_kw, **{"train.grad_accum": 2}), False),
    ])
    two = run_ranks(2, train_runs, [
        ("text2", _args(tmp, "text2", text, **{"profile.enabled": "true", "profile.start_step": 2,
                                               "profile.steps": 2}), False),
        ("noeval2", _args(tmp, "noeval2", text, **{"eval.interval": 0, "eval.at_end": "false"}), False),
        ("sft2", _args(tmp, "sft2", sft, **sft_kw), False),
        ("docs2", _args(tmp, "docs2", text, **docs_kw), False),
        # a mixture of two stores, no data.val_path: each source's own val/
        ("mix2", [a for a in _args(tmp, "mix2", text, **{"data.sources": f"{text}:1,{stores / 'text_b'}:1"})
                  if not a.startswith("--data.path=")], False),
    ])
    hsdp = run_ranks(4, train_runs, [
        ("hsdp", _args(tmp, "hsdp", text, **{"train.micro_batch_size": 1, "parallel.dp_replicate": 2,
                                             "parallel.dp_shard": 2}), False),
    ])
    return {**one, **two, **hsdp, "tmp": tmp}


def _same(a, b, what):
    assert [s for s, _ in a] == [s for s, _ in b] == [3, 6], what
    for (s, x), (_, y) in zip(a, b):
        assert abs(x - y) <= REL * abs(x), f"{what}: step {s}: {x} vs {y}"


def test_val_loss_is_the_same_on_one_two_and_hsdp_ranks(results):
    _same(results["text1"]["val"], results["text2"]["val"], "1 vs 2 ranks")
    _same(results["text1"]["val"], results["hsdp"]["val"], "1 rank vs 2x2 HSDP")
    _same(results["sft1"]["val"], results["sft2"]["val"], "SFT 1 vs 2 ranks")
    _same(results["docs1"]["val"], results["docs2"]["val"], "document masks 1 vs 2 ranks")
    # it learns, and the masks matter: the three kinds of set give different numbers
    v = results["text1"]["val"]
    assert v[1][1] < v[0][1] < math.log(320)
    assert results["docs1"]["val"][1][1] != v[1][1]


def test_val_loss_equals_a_hand_computation_and_bits_per_byte_follow(results):
    r = results["text1"]
    assert abs(r["val"][-1][1] - r["hand"]) <= REL * r["hand"]
    # the byte tokenizer: one token per byte (the EOS targets spell nothing), so bpb is just above nats/ln2
    assert r["bpb"][-1] >= r["val"][-1][1] / math.log(2) and r["bpb"][-1] < 1.1 * r["val"][-1][1] / math.log(2)
    assert results["sft1"]["bpb"] == [None, None]
    assert r["best"] == (min(x for _, x in r["val"]), 6)


def test_training_losses_are_identical_with_and_without_eval(results):
    assert results["text2"]["loss"] == results["noeval2"]["loss"]
    assert "val_loss" in results["text2"]["keys"] and "val_loss" not in results["noeval2"]["keys"]
    assert {"time_data_s", "time_compute_s", "time_optimizer_s", "time_checkpoint_s"} <= set(results["text2"]["keys"])


def test_profiler_writes_one_trace_per_rank_and_wandb_offline_a_run(results):
    tmp = results["tmp"]
    for rank in (0, 1):
        trace = tmp / "text2" / "profile" / f"rank{rank}-steps2-3.json.gz"
        events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
        steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#2", "ProfilerStep#3"}, steps
    runs = list((tmp / "text1" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and (tmp / "text1" / "wandb_id").read_text().strip() in runs[0].name
    assert list(runs[0].glob("*.wandb"))


def test_a_mixture_is_validated_on_each_sources_own_val_split(results, stores):
    """No data.val_path: the val/ of each store of the mixture (it used to say 'train on a store prepared with
    --val-fraction' about stores that were); val_loss is over all their tokens, each one's in val_loss/<name>."""
    from shardlm.data.store.format import TokenStore

    r = results["mix2"]
    last = r["last_val"]
    parts = [last["val_loss/text"], last["val_loss/text_b"]]
    assert min(parts) < last["val_loss"] < max(parts), last  # the token-weighted mean of two different sets
    rows = sum((TokenStore.open(stores / name / "val").n_tokens - 1) // 64 for name in ("text", "text_b"))
    assert r["val_rows"] == rows and last["val_tokens"] == rows * 64
    assert [s for s, _ in r["val"]] == [3, 6]
