from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from shardlm.data import PackedLoader, load_tokenizer, resolve_files
from shardlm.data.store.prepare import PrepareSpec, ensure_cached_store
from shardlm.data.sources import builtin_files, iter_documents
from shardlm.data.tokenizer import ByteTokenizer
from shardlm.errors import ConfigError, DataError


def test_builtin_corpus_is_the_stdlib():
    files = builtin_files()
    names = {f.name for f in files}
    assert {"os.py", "abc.py"} <= names and len(files) > 100
    assert not any("site-packages" in str(f) for f in files)


def test_sources_txt_jsonl_and_bad_utf8(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "one"}) + "\n\n" + json.dumps({"body": "two"}) + "\n")
    (tmp_path / "c.txt").write_bytes(b"\xff\xfe bad")
    files = resolve_files(str(tmp_path))
    assert [f.name for f in files] == ["a.txt", "b.jsonl", "c.txt"]
    # a file that is not UTF-8 is a bad record: skipped and summed up in one line, an error past the fraction
    assert list(iter_documents(files, "body", max_bad_fraction=0.25)) == ["hello", "one", "two"]
    assert capsys.readouterr().err == (f"shardlm: warning: data: 1 of 4 records skipped (1 not valid UTF-8): "
                                       f"{tmp_path / 'c.txt'} (not valid UTF-8: invalid start byte at byte 0)\n")
    with pytest.raises(DataError, match=r"1 of 4 records are bad .*c.txt \(not valid UTF-8"):
        list(iter_documents(files, "body"))
    with pytest.raises(DataError, match=r"3 of 4 records are bad .*b.jsonl:1 \(missing field 'text'\)"):
        list(iter_documents(files, "text"))


def test_stdlib_files_that_are_not_utf8_are_one_line(tmp_path, monkeypatch, capsys):
    """`make demo` opens with one note, not a warning per file (a few stdlib test files are Latin-1)."""
    monkeypatch.setattr("shardlm.data.sources.builtin.stdlib_dir", lambda: tmp_path)  # its one home
    (tmp_path / "test").mkdir()
    for name in ("a.py", "b.py", "test/c.py", "test/d.py", "test/e.py"):
        (tmp_path / name).write_bytes(b"# \xe9t\xe9\n")
    (tmp_path / "ok.py").write_text("x = 1\n")
    assert list(iter_documents(builtin_files(), "text")) == ["x = 1\n"]
    assert capsys.readouterr().err == ("shardlm: stdlib corpus: skipped 5 files that are not UTF-8 "
                                       "(a.py, b.py, test/c.py, test/d.py, and 1 more)\n")


def test_the_real_stdlib_corpus_says_at_most_one_line(capsys):
    assert sum(1 for _ in iter_documents(builtin_files(), "text")) > 100
    assert len(capsys.readouterr().err.splitlines()) <= 1


def test_missing_and_empty_paths_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_files(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"holds no data files \(.txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet"):
        resolve_files(str(tmp_path))
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ConfigError, match="unsupported file type"):
        resolve_files(str(tmp_path / "x.csv"))


def _loader_kwargs(**kw):
    base = dict(seq_len=8, micro_batch_size=2, grad_accum=1, dp_rank=0, dp_size=1, seed=0, shuffle=True)
    base.update(kw)
    return base


def build_packed_loader(files, tokenizer, text_field, cache, tokenizer_spec="bytes", **kw):
    """Files -> a store in the cache (one worker) -> a PackedLoader over it, as training does."""
    store = ensure_cached_store(PrepareSpec(files, tokenizer_spec, tokenizer.fingerprint, text_field), cache,
                                workers=1)
    if store.n_tokens == 0:
        raise DataError("the corpus is empty")
    meta = {"dtype": store.tokens.dtype.name, "documents": store.documents, "tokens": store.n_tokens}
    return PackedLoader(store.tokens, **_loader_kwargs(**kw)), meta


def test_empty_corpus_is_a_clear_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="corpus is empty"):
        build_packed_loader(resolve_files(str(tmp_path)), ByteTokenizer(), "text", tmp_path / "cache")
    (tmp_path / "empty.txt").write_text("abc")
    with pytest.raises(DataError, match="fewer than data.seq_len"):
        build_packed_loader(resolve_files(str(tmp_path)), ByteTokenizer(), "text", tmp_path / "cache")


def test_token_file_is_documents_with_eos_and_cached(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "ab"}\n{"text": "c"}\n')
    files = resolve_files(str(tmp_path))
    loader, meta = build_packed_loader(files, ByteTokenizer(), "text", tmp_path / "cache", seq_len=2)
    assert list(loader.tokens) == [97, 98, 256, 99, 256] and meta == {"dtype": "uint16", "documents": 2, "tokens": 5}
    cached = {f: f.stat().st_mtime_ns for f in (tmp_path / "cache").rglob("*")}
    build_packed_loader(files, ByteTokenizer(), "text", tmp_path / "cache", seq_len=2)
    assert {f: f.stat().st_mtime_ns for f in (tmp_path / "cache").rglob("*")} == cached  # reused, not rebuilt


def _samples(loader: PackedLoader, steps: int) -> list[list[tuple]]:
    """Per step, the rows (as tuples) this rank saw, over all micro-batches."""
    out = []
    for _ in range(steps):
        rows = []
        for x, y in loader.next_step():
            assert (x[:, 1:] == y[:, :-1]).all()  # labels are inputs shifted by one
            rows += [tuple(r.tolist()) for r in x]
        out.append(rows)
    return out


def test_global_batch_is_the_same_whatever_the_ranks_and_ranks_are_disjoint():
    tokens = np.arange(2000, dtype=np.uint16) % 250
    ref = _samples(PackedLoader(tokens, 8, micro_batch_size=4, grad_accum=2, dp_rank=0, dp_size=1), 5)
    for dp, mbs, accum in ((2, 2, 2), (4, 1, 2), (2, 4, 1), (8, 1, 1)):
        per_rank = [_samples(PackedLoader(tokens, 8, mbs, accum, r, dp), 5) for r in range(dp)]
        for step in range(5):
            got = [row for rank in per_rank for row in rank[step]]
            assert sorted(got) == sorted(ref[step]), (dp, mbs, accum, step)
            assert len(set(got)) == len(got)  # no two ranks read the same sequence


def test_resume_continues_exactly_also_on_another_dp_degree():
    tokens = np.arange(3000, dtype=np.uint16) % 250
    straight = _samples(PackedLoader(tokens, 8, 2, 1, 0, 1), 6)
    first = PackedLoader(tokens, 8, 2, 1, 0, 1)
    _samples(first, 3)
    state = first.state_dict()
    halves = []
    for r in range(2):  # resume on 2 ranks, micro-batch 1: the same global batches
        again = PackedLoader(tokens, 8, 1, 1, r, 2)
        again.load_state_dict(state)
        halves.append(_samples(again, 3))
    for step in range(3):
        assert sorted(halves[0][step] + halves[1][step]) == sorted(straight[3 + step])


def test_epochs_reshuffle_and_cover_every_window():
    tokens = np.arange(81, dtype=np.uint16)
    loader = PackedLoader(tokens, 8, micro_batch_size=1, grad_accum=1, dp_rank=0, dp_size=1, seed=3)
    firsts = [loader.next_step()[0][0][0, 0].item() for _ in range(20)]
    assert sorted(firsts[:10]) == list(range(0, 80, 8)) and sorted(firsts[10:]) == list(range(0, 80, 8))
    assert firsts[:10] != firsts[10:]


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def foo(): return 1\n"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(str(tmp_path))
    assert hf.eos_id == tok.token_to_id("<|endoftext|>") and hf.vocab_size == tok.get_vocab_size()
    ids = hf.encode("def foo(): return 1")
    assert hf.decode(ids).strip() == "def foo(): return 1"
    (tmp_path / "d.txt").write_text("def foo(): return 1\n" * 20)
    loader, meta = build_packed_loader([tmp_path / "d.txt"], hf, "text", tmp_path / "cache", str(tmp_path), seq_len=4)
    assert loader.tokens[-1] == hf.eos_id and meta["tokens"] == len(hf.encode((tmp_path / "d.txt").read_text())) + 1
    with pytest.raises(ConfigError, match="no tokenizer.json there"):
        load_tokenizer(str(tmp_path / "nope"))


def test_sample_order_state_is_a_tensor_and_resumes_from_one():
    import torch

    from shardlm.data import SampleOrder

    order = SampleOrder(10, micro_batch_size=2, grad_accum=2, dp_rank=1, dp_size=2, seed=1)
    assert order.global_batch == 8
    steps = [order.rows_for_step() for _ in range(3)]
    assert all(len(s) == 2 and all(len(mb) == 2 for mb in s) for s in steps)
    state = order.state_dict()
    assert set(state) == {"samples_seen", "order_version"} and isinstance(state["samples_seen"], torch.Tensor)
    assert int(state["samples_seen"]) == 24
    again = SampleOrder(10, 2, 2, 1, 2, seed=1)
    again.load_state_dict({"samples_seen": 16, "order_version": 2})  # plain ints too
    assert again.rows_for_step() == steps[2]
    loader = PackedLoader(np.arange(200, dtype=np.uint16), 8, 2, 1, 0, 1)
    loader.next_step()
    sd = loader.state_dict()
    assert isinstance(sd["samples_seen"], torch.Tensor) and loader.samples_seen == 2
    fresh = PackedLoader(np.arange(200, dtype=np.uint16), 8, 2, 1, 0, 1)
    fresh.load_state_dict(sd)
    assert fresh.samples_seen == 2 and [x.tolist() for x, _ in fresh.next_step()] == \
        [x.tolist() for x, _ in loader.next_step()]


def test_build_loader_branches_on_the_format_with_one_stats_shape(tmp_path):
    from shardlm.config import Config
    from shardlm.data import build_loader
    from shardlm.data.sft import SFTLoader

    (tmp_path / "t.txt").write_text("hello world, " * 20)
    (tmp_path / "s.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "completion": "a" * i}) + "\n"
                                              for i in range(1, 6)))
    shapes, logs = [], []
    for fmt, path in (("text", "t.txt"), ("sft", "s.jsonl")):
        cfg = Config()
        cfg.data.format, cfg.data.path, cfg.data.seq_len = fmt, str(tmp_path / path), 32
        cfg.data.cache_dir = str(tmp_path / "cache")
        t = cfg.train
        loader, stats = build_loader(cfg.data, ByteTokenizer(), 0, 1, micro_batch_size=t.micro_batch_size,
                                     grad_accum=t.grad_accum, seed=t.seed, log=logs.append)
        assert isinstance(loader, SFTLoader if fmt == "sft" else PackedLoader)
        assert stats["format"] == fmt and stats["rows"] == loader.n_rows and stats["tokens"] > 0
        shapes.append(set(stats))
        if fmt == "text":
            assert stats["documents"] == 1 and stats["tokens"] == 13 * 20 + 1 and stats["fill"] == 1.0
            assert stats["template"] is None and len(logs) == 1 and logs.pop().startswith("prepare: wrote ")
        else:
            assert stats["documents"] == stats["samples"] == 5 and stats["template"] == "plain"
            # SFT records go through a store too: prepared once (a line), then the loader's line
            assert len(logs) == 2 and logs[0].startswith("prepare: wrote ") and "5 SFT samples" in logs[0]
            line = logs[1]
            assert line.startswith("sft data: 5 samples") and f"{loader.n_rows} rows" in line
            assert "plain ### User/### Assistant template," in line and "plain template" not in line
    assert shapes[0] == shapes[1]


def test_builtin_files_depths_are_the_top_level_and_one_folder_down():
    from shardlm.data.sources import stdlib_dir

    root = stdlib_dir()
    top = builtin_files(max_depth=0)
    assert top == sorted(root.glob("*.py")) and top == builtin_files()[: len(top)]
    one = builtin_files(max_depth=1)
    want = [f for f in sorted(root.glob("*/*.py")) if f.parent.name not in ("site-packages", "dist-packages")]
    assert one[: len(top)] == top and one[len(top):] == want


def test_unreadable_tokenizer_is_a_data_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot read tokenizer"):
        load_tokenizer(str(tmp_path))
