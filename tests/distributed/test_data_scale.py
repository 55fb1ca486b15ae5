"""Data at cluster scale, trained on real gloo ranks: every source format trains (one mixture of all of them on
2 ranks); a token store trains exactly like the raw files it was made from; a 3:1 mixture resumed on another
number of ranks (twice) equals the run straight through; document masking gives the same losses on 1 and 2
ranks."""

from __future__ import annotations

import gzip
import json

import pytest
from helpers.launch import run_ranks

STEPS = 8
REL = 1e-5


def _docs(n: int, seed: int, tag: str) -> list[str]:
    """Documents of varied length (a few words to ~1.5 rows of 64 bytes), deterministic."""
    import random

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "self", "import", "print", tag]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 20))) for _ in range(n)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """One corpus per format: parquet (3 row groups, a null, text in `body`), arrow IPC, an HF save_to_disk
    folder, jsonl.gz, jsonl.zst."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    d = tmp_path_factory.mktemp("sources")
    docs = {k: _docs(300, i, k) for i, k in enumerate(["pq", "arrow", "hf", "gz", "zst"])}
    body = docs["pq"][:150] + [None] + docs["pq"][150:]
    pq.write_table(pa.table({"id": list(range(len(body))), "body": body}), d / "p.parquet", row_group_size=110)
    table = pa.table({"text": docs["arrow"]})
    with pa.OSFile(str(d / "a.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=100)
    datasets.Dataset.from_dict({"text": docs["hf"]}).save_to_disk(str(d / "hf"), num_shards=2)
    lines = lambda k: "".join(json.dumps({"text": t}) + "\n" for t in docs[k]).encode()  # noqa: E731
    (d / "g.jsonl.gz").write_bytes(gzip.compress(lines("gz")))
    (d / "z.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines("zst")))
    return d


def _args(tmp, tag, **extra) -> list[str]:
    o = {"model.preset": "debug", "train.steps": STEPS, "train.output_dir": f"{tmp}/{tag}",
         "train.mixed_precision": "fp32", "train.micro_batch_size": 2, "train.grad_accum": 1, "train.lr": 3e-3,
         "train.warmup_steps": 2, "data.seq_len": 64, "data.tokenizer": "bytes", "data.cache_dir": f"{tmp}/cache",
         "metrics.log_every": 1, "metrics.progress_bar": False, "checkpoint.save_final": False,
         "train.sample_tokens": 0, "data.max_bad_fraction": 0.01}
    o.update(extra)
    return [f"--{k}={v}" for k, v in o.items()]


def _toml(path, sources: list[dict]) -> str:
    path.write_text("".join("[[data.sources]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in s.items())
                            for s in sources))
    return str(path)


def train_runs(runs: list[tuple[str, str | None, list[str], int | None]]) -> dict[str, dict]:
    """Each (tag, config file, overrides, stop_after) trained in turn; per run the losses and the mixture's
    state. `stop_after=k` stops after step k the way SIGTERM does (request -> save -> stop)."""
    from shardlm.config import load_config
    from shardlm.train.trainer import Trainer

    class StopAfter(Trainer):
        stop_after: int | None = None

        def train_step(self, batches, stop_requested=False):
            if self.step + 1 == self.stop_after:
                self.preemption.requested = stop_requested = True
            return super().train_step(batches, stop_requested)

    out = {}
    for tag, config, overrides, stop_after in runs:
        StopAfter.stop_after = stop_after
        t = StopAfter(load_config(config, overrides))
        recs = t.train()
        order = t.loader.order
        out[tag] = {"loss": [r["loss"] for r in recs], "step": t.step,
                    "consumed": list(getattr(order, "consumed", [])), "data": t.data_meta}
        t.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory, sources):
    from shardlm.data.sources import resolve_sources
    from shardlm.data.store.prepare import PrepareSpec, prepare
    from shardlm.data.tokenizer import ByteTokenizer

    tmp = tmp_path_factory.mktemp("scale")
    every = _toml(tmp / "every.toml", [{"path": str(sources / "p.parquet"), "text_field": "body"},
                                       {"path": str(sources / "a.arrow")}, {"path": str(sources / "hf")},
                                       {"path": str(sources / "g.jsonl.gz")}, {"path": str(sources / "z.jsonl.zst")}])
    mix = _toml(tmp / "mix.toml", [{"path": str(sources / "g.jsonl.gz"), "weight": 3},
                                   {"path": str(sources / "a.arrow"), "weight": 1}])
    # the store `shardlm prepare` makes of the .zst (2 workers), and the raw .zst: the same training
    prepare(PrepareSpec(resolve_sources(str(sources / "z.jsonl.zst")), "bytes", ByteTokenizer.fingerprint, "text"),
            tmp / "zst_store", workers=2, log=lambda _: None)
    docs_args = dict(**{"data.path": str(sources / "g.jsonl.gz"), "data.document_mask": "true"})
    mix20 = dict(**{"train.steps": 20})
    two = run_ranks(2, train_runs, [
        ("every", every, _args(tmp, "every"), None),
        ("raw", None, _args(tmp, "raw", **{"data.path": str(sources / "z.jsonl.zst")}), None),
        ("store", None, _args(tmp, "store", **{"data.path": f"store:{tmp / 'zst_store'}"}), None),
        ("mix_straight", mix, _args(tmp, "mix_straight", **mix20), None),
        ("mix_a", mix, _args(tmp, "mix_resumed", **mix20), 7),
        ("docs2", None, _args(tmp, "docs2", **docs_args), None),
        ("nodocs2", None, _args(tmp, "nodocs2", **{"data.path": str(sources / "g.jsonl.gz")}), None),
    ])
    one = run_ranks(1, train_runs, [
        # the same global batch of 4 on one rank: micro-batch 2 x accumulation 2
        ("mix_b", mix, _args(tmp, "mix_resumed", **mix20, **{"train.grad_accum": 2}), 14),
        ("docs1", None, _args(tmp, "docs1", **docs_args, **{"train.grad_accum": 2}), None),
    ])
    two_again = run_ranks(2, train_runs, [("mix_c", mix, _args(tmp, "mix_resumed", **mix20), None)])
    return {**two, **one, **two_again}


def _same(a: list[float], b: list[float], what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= REL * abs(x), f"{what}: step {i + 1}: {x} vs {y}"


def test_every_source_format_trains_on_two_ranks(results):
    r = results["every"]
    assert r["step"] == STEPS and r["loss"][-1] < r["loss"][0] - 0.5, r["loss"]
    assert r["data"]["documents"] == 5 * 300  # the parquet null skipped, every other record read
    assert sum(r["consumed"]) == STEPS * 4 and all(c > 0 for c in r["consumed"])


def test_a_store_trains_exactly_like_its_raw_files(results):
    assert results["store"]["loss"] == results["raw"]["loss"] and len(results["raw"]["loss"]) == STEPS


def test_a_mixture_resumed_twice_on_other_rank_counts_equals_the_straight_run(results):
    straight = results["mix_straight"]
    resumed = results["mix_a"]["loss"] + results["mix_b"]["loss"] + results["mix_c"]["loss"]
    assert [len(results[k]["loss"]) for k in ("mix_a", "mix_b", "mix_c")] == [7, 7, 6]
    _same(straight["loss"], resumed, "3:1 mixture, 2 -> 1 -> 2 ranks")
    assert results["mix_c"]["consumed"] == straight["consumed"] == [60, 20]  # 3:1 of 20 steps x 4 samples


def test_document_masking_is_the_same_on_one_and_two_ranks(results):
    _same(results["docs1"]["loss"], results["docs2"]["loss"], "document masks, 1 vs 2 ranks")
    same_data = results["nodocs2"]["loss"]
    assert same_data[0] != results["docs2"]["loss"][0], "the masks change the very first forward"
