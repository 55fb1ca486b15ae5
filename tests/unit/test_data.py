from __future__ import annotations

import json

import numpy as np
import pytest

from shardlm.data import PackedLoader, build_loader, load_tokenizer, resolve_files
from shardlm.data.sources import builtin_files, iter_documents
from shardlm.data.tokenizer import ByteTokenizer
from shardlm.errors import ConfigError


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
    assert list(iter_documents(files, "body")) == ["hello", "one", "two"]
    err = capsys.readouterr().err
    assert "warning: skipping" in err and "c.txt: not valid UTF-8" in err
    with pytest.raises(ConfigError, match=r"b.jsonl:1: no string field 'text'"):
        list(iter_documents(files, "text"))


def test_missing_and_empty_paths_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_files(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="holds no .txt or .jsonl"):
        resolve_files(str(tmp_path))
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ConfigError, match="unsupported file type"):
        resolve_files(str(tmp_path / "x.csv"))


def _loader_kwargs(**kw):
    base = dict(seq_len=8, micro_batch_size=2, grad_accum=1, dp_rank=0, dp_size=1, seed=0, shuffle=True,
                is_builder=True, barrier=lambda: None)
    base.update(kw)
    return base


def test_empty_corpus_is_a_clear_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="corpus is empty"):
        build_loader(resolve_files(str(tmp_path)), ByteTokenizer(), "text", tmp_path / "cache", **_loader_kwargs())
    (tmp_path / "empty.txt").write_text("abc")
    with pytest.raises(ConfigError, match="fewer than data.seq_len"):
        build_loader(resolve_files(str(tmp_path)), ByteTokenizer(), "text", tmp_path / "cache", **_loader_kwargs())


def test_token_file_is_documents_with_eos_and_cached(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "ab"}\n{"text": "c"}\n')
    files = resolve_files(str(tmp_path))
    loader, meta = build_loader(files, ByteTokenizer(), "text", tmp_path / "cache", **_loader_kwargs(seq_len=2))
    assert list(loader.tokens) == [97, 98, 256, 99, 256] and meta == {"dtype": "uint16", "documents": 2, "tokens": 5}
    cached = sorted((tmp_path / "cache").iterdir())
    build_loader(files, ByteTokenizer(), "text", tmp_path / "cache", **_loader_kwargs(seq_len=2))
    assert sorted((tmp_path / "cache").iterdir()) == cached  # reused, not rebuilt


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
    loader, meta = build_loader([tmp_path / "d.txt"], hf, "text", tmp_path / "cache", **_loader_kwargs(seq_len=4))
    assert loader.tokens[-1] == hf.eos_id and meta["tokens"] == len(hf.encode((tmp_path / "d.txt").read_text())) + 1
    with pytest.raises(ConfigError, match="no tokenizer.json there"):
        load_tokenizer(str(tmp_path / "nope"))
