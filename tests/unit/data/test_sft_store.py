"""SFT through the token store: records are rendered and tokenised once, offline and in parallel, into a store of
kind "sft" (ids + one-byte answer masks + per-sample answer info); a rank keeps only lengths and the packing and
reads a row's tokens from the memory map. The rows equal the in-memory path's, sample for sample."""

from __future__ import annotations

import json
import tracemalloc
from bisect import bisect_left, insort
from pathlib import Path

import numpy as np
import pytest
from helpers.packing import pack_best_fit

from shardlm.cli import main
from shardlm.config import Config
from shardlm.data.store import prepare as P
from shardlm.data.chat import answer_info, load_template, record_key, record_to_messages, tokenize_records
from shardlm.data.loader import build_loader, open_stores
from shardlm.data.sft import SFTLoader, SFTSamples, pack_rows
from shardlm.data.store.format import TokenStore
from shardlm.data.store.prepare import prepare, sft_spec
from shardlm.data.tokenizer import ByteTokenizer
from shardlm.errors import ConfigError, DataError

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _records(n: int) -> list[dict]:
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append({"prompt": f"question {i}?", "completion": "answer " * (i % 11) + "done"})
        elif i % 3 == 1:
            out.append({"instruction": f"do {i}", "input": "x" * (i % 5), "output": f"did {i}" * (1 + i % 4)})
        else:
            out.append({"messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": f"hi {i}"},
                                     {"role": "assistant", "content": f"hello {i}"},
                                     {"role": "user", "content": "more"},
                                     {"role": "assistant", "content": "more " * (i % 7)}]})
    return out


def _write(d: Path, records: list[dict], template: str | None = CHATML, bad: bool = False) -> Path:
    """records over a .jsonl (several units at chunk 1 KiB) and a parquet file (as conversations: one shape per
    file, as datasets have it); a chat template in d/../tok."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d.mkdir(parents=True, exist_ok=True)
    half = len(records) // 2
    (d / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:half]) + ("not json\n" if bad else ""))
    rows = [{"messages": record_to_messages(r, "x")} for r in records[half:]]  # one shape per file, as datasets are
    pq.write_table(pa.Table.from_pylist(rows), d / "b.parquet", row_group_size=7)
    tok_dir = d.parent / "tok"
    tok_dir.mkdir(exist_ok=True)
    if template:
        (tok_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return tok_dir


def _spec(src: Path, tok_dir, **kw):
    files = [src / "a.jsonl", src / "b.parquet"]
    spec = sft_spec(files, ByteTokenizer(), tok_dir)
    spec.chunk_bytes = 1024
    for k, v in kw.items():
        setattr(spec, k, v)
    return spec


def _tree(d: Path) -> dict[str, bytes]:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def test_sft_store_is_worker_independent_and_holds_each_records_rendered_ids_and_mask(tmp_path, monkeypatch):
    records = _records(120)
    tok_dir = _write(tmp_path / "src", records, bad=True)
    logs: list[str] = []
    one = prepare(_spec(tmp_path / "src", tok_dir), tmp_path / "one", workers=1, log=logs.append, max_bad_fraction=0.05)
    monkeypatch.setattr(P, "POOL_BYTES_PER_WORKER", 1)
    two = prepare(_spec(tmp_path / "src", tok_dir), tmp_path / "two", workers=2, log=logs.append, max_bad_fraction=0.05)
    assert logs[-1].endswith("with 2 workers") and "120 SFT samples" in logs[-1]
    assert _tree(tmp_path / "one") == _tree(tmp_path / "two")
    assert set(_tree(tmp_path / "one")) == {"manifest.json", "tokens.bin", "docs.idx", "mask.bin", "answers.idx"}
    assert one.kind == "sft" and one.manifest["template"]["name"] == "chat_template"
    assert one.manifest["bad_records"]["bad"] == 1  # the "not json" line, counted, not fatal
    one.verify()
    # sample by sample: what the chat module renders and tokenises for that record
    tok = ByteTokenizer()
    template = load_template(tok, tok_dir)
    want = list(tokenize_records([(record_to_messages(r, "x"), "x") for r in records], tok, template))
    assert one.documents == len(records)
    for i, (ids, mask) in enumerate(want):
        a, b = one.starts[i], one.starts[i + 1]
        assert one.tokens[a:b].tolist() == ids.tolist()
        assert one.mask[a:b].astype(bool).tolist() == mask.tolist()
        assert tuple(one.answers[i]) == answer_info(mask)
    # a flipped mask byte is caught by --verify
    raw = bytearray((tmp_path / "one" / "mask.bin").read_bytes())
    raw[5] ^= 1
    (tmp_path / "one" / "mask.bin").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="mask.bin does not match its checksum"):
        TokenStore.open(tmp_path / "one").verify()


def test_sft_validation_split_is_by_record_content(tmp_path):
    records = _records(200)
    tok_dir = _write(tmp_path / "src", records)
    store = prepare(_spec(tmp_path / "src", tok_dir, val_fraction=0.2, seed=3), tmp_path / "s", workers=1,
                    log=lambda _: None)
    val = store.val()
    assert val is not None and val.kind == "sft" and store.documents + val.documents == 200
    assert 20 <= val.documents <= 60
    keys = [record_key(record_to_messages(r, "x")) for r in records]
    held = [k for k in keys if P.in_val(k, 3, 0.2)]
    assert len(held) == val.documents


def _reference_best_fit(lengths, capacity):
    """The packing before it moved to per-room heaps: sorted (room, row) list, bisect + insort."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows, free = [], []
    for i in order:
        n = lengths[i]
        j = bisect_left(free, (n, -1))
        if j == len(free):
            rows.append([i])
            row, room = len(rows) - 1, capacity - n
        else:
            room, row = free.pop(j)
            rows[row].append(i)
            room -= n
        if room > 0:
            insort(free, (room, row))
    return rows


def test_packing_equals_the_reference_best_fit():
    rng = np.random.default_rng(0)
    for capacity in (8, 64, 1000):
        lengths = rng.integers(1, capacity + 1, size=3000).tolist()
        assert pack_best_fit(lengths, capacity) == _reference_best_fit(lengths, capacity)


def test_loader_over_a_store_equals_the_in_memory_samples(tmp_path):
    records = _records(90)
    tok_dir = _write(tmp_path / "src", records)
    store = prepare(_spec(tmp_path / "src", tok_dir), tmp_path / "s", workers=1, log=lambda _: None)
    tok = ByteTokenizer()
    pairs = list(tokenize_records([(record_to_messages(r, "x"), "x") for r in records], tok,
                                  load_template(tok, tok_dir)))
    for L, pack, mask in ((72, True, True), (72, False, False), (256, True, False)):
        kw = dict(micro_batch_size=2, grad_accum=2, dp_rank=0, dp_size=1, seed=1, pack=pack, pad_id=tok.eos_id,
                  document_mask=mask)
        a, b = SFTLoader(SFTSamples.from_store(store), L, **kw), SFTLoader(pairs, L, **kw)
        assert a.stats == b.stats and a.n_rows == b.n_rows
        if L == 72:
            assert a.stats["truncated"] > 0 and a.stats["dropped"] > 0  # both paths exercised
        for _ in range(4):
            for x, y in zip(a.next_step(), b.next_step()):
                assert all((p == q).all() for p, q in zip(x, y))
        assert isinstance(a.data.ids, np.memmap) and isinstance(a.data.mask, np.memmap)


def test_a_rank_holds_tens_of_bytes_per_sample_not_the_tokens(tmp_path):
    n, per = 200_000, 40
    ids = np.memmap(tmp_path / "ids", dtype=np.uint16, mode="w+", shape=(n * per,))
    ids[:] = 7
    mask = np.memmap(tmp_path / "mask", dtype=np.uint8, mode="w+", shape=(n * per,))
    mask.reshape(n, per)[:, per // 2:] = 1
    starts = np.arange(n + 1, dtype=np.int64) * per
    answers = np.tile(np.array([[per // 2, per - per // 2]], dtype=np.int64), (n, 1))
    samples = SFTSamples(ids, mask, starts, answers)
    tracemalloc.start()
    loader = SFTLoader(samples, 64, 4, 1, 0, 2, pack=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert loader.n_rows == -(-n // (64 // (per - 1)))
    assert peak / n < 100, f"{peak / n:.0f} bytes per sample while building the loader"
    held = sum(a.nbytes for a in (loader._kept, loader._start, loader.lengths, loader._ptr, loader._items))
    assert held / n < 32 and held < ids.nbytes


def test_training_config_on_sft_stores_and_the_mismatch_errors(tmp_path):
    records = _records(30)
    tok_dir = _write(tmp_path / "src", records, template=None)  # the plain template
    out = tmp_path / "store"
    assert main(["prepare", str(tmp_path / "src" / "a.jsonl"), str(out), "--data.format=sft"]) == 0
    cfg = Config()
    cfg.data.format, cfg.data.path, cfg.data.seq_len, cfg.data.cache_dir = "sft", str(out), 64, str(tmp_path / "c")
    train = dict(micro_batch_size=cfg.train.micro_batch_size, grad_accum=cfg.train.grad_accum, seed=cfg.train.seed)
    loader, stats = build_loader(cfg.data, ByteTokenizer(), 0, 1, **train, log=lambda _: None)
    assert stats["template"] == "plain" and stats["documents"] == 15 and isinstance(loader, SFTLoader)
    # the same records as raw files: prepared into the cache, the same rows
    raw = Config()
    raw.data.format, raw.data.path, raw.data.seq_len = "sft", str(tmp_path / "src" / "a.jsonl"), 64
    raw.data.cache_dir = str(tmp_path / "c")
    loader2, _ = build_loader(raw.data, ByteTokenizer(), 0, 1, **train, log=lambda _: None)
    assert all((p == q).all() for p, q in zip(loader.next_step()[0], loader2.next_step()[0]))
    # an SFT store read as text, a text store read as SFT, a store rendered with another template
    cfg.data.format = "text"
    with pytest.raises(ConfigError, match="token store of sft data but data.format=text; set data.format=sft"):
        open_stores(cfg.data, ByteTokenizer())
    (tmp_path / "t.txt").write_text("plain text " * 50)
    assert main(["prepare", str(tmp_path / "t.txt"), str(tmp_path / "tstore")]) == 0
    cfg.data.format, cfg.data.path = "sft", str(tmp_path / "tstore")
    with pytest.raises(ConfigError, match="token store of text data but data.format=sft.*--data.format sft"):
        open_stores(cfg.data, ByteTokenizer())
    (tmp_path / "tok2").mkdir()
    (tmp_path / "tok2" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    store = TokenStore.open(out)
    with pytest.raises(ConfigError, match="rendered with the plain template.*chat_template"):
        store.check_template(load_template(ByteTokenizer(), tmp_path / "tok2"))
