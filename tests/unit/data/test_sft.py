from __future__ import annotations

import json
import re

import numpy as np
import pytest
from helpers.packing import pack_best_fit

from shardlm.data.loader import IGNORE_INDEX
from shardlm.data.sft import (
    ChatTemplate,
    PlainTemplate,
    SFTLoader,
    build_sft_loader,
)
from shardlm.data.tokenizer import ByteTokenizer, load_tokenizer
from shardlm.errors import ConfigError, DataError

CHATML = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' and loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'user' %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    """build_sft_loader prepares a store in the data cache: a fresh one per test, never ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("bpe")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["### User:\nWhat is two plus two?\n\n### Assistant:\nTwo plus two is four.",
              "system user assistant: hello there, general answer, the quick brown fox jumps over the lazy dog"]
    tok.train_from_iterator(corpus * 30, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    return d


def _write_chat_config(d, template=CHATML):
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "bos_token": "<s>",
        "eos_token": {"content": "<|im_end|>", "lstrip": False}, "pad_token": "<|endoftext|>"}))


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _kw(**kw):
    base = dict(seq_len=256, micro_batch_size=1, grad_accum=1, dp_rank=0, dp_size=1, seed=0, shuffle=False, pack=False)
    base.update(kw)
    return base


def _sample_rows(loader):
    """Each row as (inputs, labels) lists, trailing padding dropped (pad mode: one sample per row)."""
    out = []
    for w in range(loader.n_rows):
        x, y = loader.row(w)
        n = sum(int(loader.lengths[i]) for i in loader.row_samples(w))
        out.append((x[:n].tolist(), y[:n].tolist()))
    return out


def _loss_ids(y):
    return [t for t in y if t != IGNORE_INDEX]


# -- masking -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_plain_template_loss_is_exactly_the_completion_and_eos(tmp_path, bpe_dir, kind):
    tok = ByteTokenizer() if kind == "bytes" else load_tokenizer(str(bpe_dir))
    prompt, completion = "What is two plus two?", "Two plus two is four."
    f = _jsonl(tmp_path / "d.jsonl", [{"prompt": prompt, "completion": completion}])
    loader, stats = build_sft_loader([f], tok, None, **_kw())  # no template dir: plain template
    assert stats["template"] == "plain" and stats["samples"] == 1 and stats["truncated"] == 0
    (x, y), = _sample_rows(loader)
    assert _loss_ids(y) == tok.encode(completion) + [tok.eos_id]
    assert stats["loss_tokens"] == len(tok.encode(completion)) + 1
    # the inputs are the rendered sample without its last token (EOS), in the documented format
    full = x + [y[-1]]
    assert full[-1] == tok.eos_id
    assert tok.decode(full[:-1]) == f"### User:\n{prompt}\n\n### Assistant:\n{completion}"
    assert stats["tokens"] == len(full)
    # labels are inputs shifted by one wherever there is a label
    assert all(lab == full[t + 1] for t, lab in enumerate(y) if lab != IGNORE_INDEX)


def test_plain_template_multi_turn_and_system(tmp_path):
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Ciao"}]
    f = _jsonl(tmp_path / "d.jsonl", [{"messages": msgs}])
    loader, stats = build_sft_loader([f], tok, tmp_path, **_kw())  # a dir without a template: plain
    (x, y), = _sample_rows(loader)
    assert stats["template"] == "plain"
    assert _loss_ids(y) == list(b"Hello") + [256] + list(b"Ciao") + [256]
    text = tok.decode(x)
    assert text == "### System:\nBe brief.\n\n### User:\nHi\n\n### Assistant:\nHello### User:\nBye\n\n### Assistant:\nCiao"


def test_chat_template_multi_turn_only_assistant_turns_count(tmp_path, bpe_dir):
    _write_chat_config(bpe_dir)
    tok = load_tokenizer(str(bpe_dir))
    msgs = [{"role": "system", "content": "You answer."}, {"role": "user", "content": "What is two plus two?"},
            {"role": "assistant", "content": "Two plus two is four."}, {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "general answer"}]
    f = _jsonl(tmp_path / "d.jsonl", [{"messages": msgs}])
    loader, stats = build_sft_loader([f], tok, bpe_dir, **_kw())
    assert stats["template"] == "chat_template"
    (x, y), = _sample_rows(loader)
    want = tok.encode("Two plus two is four.<|im_end|>") + tok.encode("general answer<|im_end|>")
    assert _loss_ids(y) == want and stats["loss_tokens"] == len(want)
    im_end = tok.tok.token_to_id("<|im_end|>")
    assert want.count(im_end) == 2  # the end-of-turn marker of each answer is a target, as one token
    template = ChatTemplate.from_dir(bpe_dir)
    rendered = template.render(msgs)
    assert rendered.startswith("<s><|im_start|>system\nYou answer.<|im_end|>\n<|im_start|>user\n")
    segments = template.segments(msgs)
    assert "".join(s for s, _ in segments) == rendered
    assert [s for s, loss in segments if loss] == ["Two plus two is four.<|im_end|>", "general answer<|im_end|>"]
    full = [t for s, _ in segments for t in tok.encode(s)]
    assert x == full[:-1] and full[0] == tok.tok.token_to_id("<s>") and y[-1] == IGNORE_INDEX  # final "\n"
    # the first prompt is tokenised exactly as at inference (render with add_generation_prompt)
    prompt = ChatTemplate.from_dir(bpe_dir).render(msgs[:2], add_generation_prompt=True)
    n = len(tok.encode(prompt))
    assert full[:n] == tok.encode(prompt) and y[n - 1] != IGNORE_INDEX and all(t == IGNORE_INDEX for t in y[: n - 1])


def test_chat_template_matches_transformers_rendering(tmp_path, bpe_dir):
    transformers = pytest.importorskip("transformers")
    _write_chat_config(bpe_dir)
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bpe_dir / "tokenizer.json"), bos_token="<s>",
                                              eos_token="<|im_end|>", chat_template=CHATML)
    ours = ChatTemplate.from_dir(bpe_dir)
    for gen in (False, True):
        assert ours.render(msgs, add_generation_prompt=gen) == hf.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=gen)


def test_chat_template_without_prefix_property_falls_back_to_search(tmp_path):
    # renders a marker after the last message only, so partial renders are not prefixes of the full one
    tpl = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}{{ eos_token if m['role'] == 'assistant' }}"
           "{% if loop.last %}[END]{% endif %}{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl, "eos_token": "</s>"}))
    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": " a1 "},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    t = ChatTemplate.from_dir(tmp_path)
    text, spans = t.spans(msgs)
    assert text == "<user>q1<assistant>a1</s><user>q2<assistant>a2</s>[END]"
    assert [text[a:b] for a, b in spans] == ["a1</s>", "a2</s>"]
    f = _jsonl(tmp_path / "d.jsonl", [{"messages": msgs}])
    loader, _ = build_sft_loader([f], ByteTokenizer(), tmp_path, **_kw())
    (x, y), = _sample_rows(loader)
    assert bytes(_loss_ids(y)) == b"a1</s>a2</s>"


def test_chat_template_errors_name_the_record(tmp_path, bpe_dir):
    _write_chat_config(bpe_dir)
    tok = load_tokenizer(str(bpe_dir))
    f = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"},
                                      {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                                    {"role": "assistant", "content": "c"}]}])
    with pytest.raises(DataError, match=r"d.jsonl:2: the chat template refused this record: roles must alternate"):
        build_sft_loader([f], tok, bpe_dir, **_kw())
    # content rendered changed (upper) and partial renders not prefixes (the "!" after the last message)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}{{ m['content'] | upper }}{% if loop.last %}!{% endif %}{% endfor %}"}))
    with pytest.raises(DataError, match=r"d.jsonl:1: the chat template does not render assistant message 1 verbatim"):
        build_sft_loader([f], ByteTokenizer(), tmp_path, **_kw())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(DataError, match="chat template: syntax error"):
        build_sft_loader([f], ByteTokenizer(), tmp_path, **_kw())


def test_chat_template_jinja_file_and_sandbox(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{{ ''.__class__.__mro__ }}{{ messages[0]['content'] }}")
    f = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match=r"d.jsonl:1: the chat template refused this record: .*unsafe"):
        build_sft_loader([f], ByteTokenizer(), tmp_path, **_kw())  # the sandbox holds
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}{{ messages | tojson }}")
    out = ChatTemplate.from_dir(tmp_path).render([{"role": "user", "content": "é"}])
    assert out == 'u:é|[{"role": "user", "content": "é"}]'


# -- record shapes -----------------------------------------------------------------------------------
def test_alpaca_shape_with_and_without_input(tmp_path):
    tok = ByteTokenizer()
    f = _jsonl(tmp_path / "d.jsonl", [{"instruction": "Add", "input": "2 2", "output": "4"},
                                      {"instruction": "Say hi", "output": "hi"},
                                      {"instruction": "Say yo", "input": "", "output": "yo"}])
    loader, stats = build_sft_loader([f], tok, None, **_kw())
    assert stats["records"] == stats["samples"] == 3
    texts = [tok.decode(x + [y[-1]]) for x, y in _sample_rows(loader)]
    assert texts == ["### User:\nAdd\n\n2 2\n\n### Assistant:\n4", "### User:\nSay hi\n\n### Assistant:\nhi",
                     "### User:\nSay yo\n\n### Assistant:\nyo"]
    assert [bytes(_loss_ids(y)[:-1]) for _, y in _sample_rows(loader)] == [b"4", b"hi", b"yo"]


@pytest.mark.parametrize("record, why", [
    ({"text": "x"}, "no known fields"),
    ({"prompt": "x"}, '"prompt" and "completion" must both be strings'),
    ({"instruction": "x", "output": 3}, '"instruction" and "output" must be strings'),
    ({"messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\] must be"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
    ({"messages": []}, "non-empty list"),
    ([1, 2], "not a JSON object"),
])
def test_bad_record_names_file_line_and_shapes(tmp_path, record, why):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError) as e:  # 1 of 2 records bad: past data.max_bad_fraction
        build_sft_loader([f], ByteTokenizer(), None, **_kw())
    msg = str(e.value)
    assert msg.startswith("data: 1 of 2 records are bad (50.00%, more than data.max_bad_fraction=0.001): ")
    assert f"{f}:3 (" in msg and re.search(why, msg.split(f"{f}:3 (")[1]), msg
    assert "\n" not in msg
    if why != "not a JSON object":  # the readers' reason (not a record at all); the others name the shapes
        assert '"messages"' in msg and '"prompt"' in msg and '"instruction"' in msg
    # within the allowed share it is skipped and counted: one sample left
    _, stats = build_sft_loader([f], ByteTokenizer(), None, **_kw(), max_bad_fraction=0.5)
    assert stats["records"] == 1


def test_bad_json_non_jsonl_and_empty_data_are_clear(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{oops\n')
    with pytest.raises(DataError, match=r"d.jsonl:2 \(not valid JSON: Expecting property name"):
        build_sft_loader([tmp_path / "d.jsonl"], ByteTokenizer(), None, **_kw())
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"t.txt: a text file has no records; use .jsonl\(.gz/.zst\), .parquet"):
        build_sft_loader([tmp_path / "t.txt"], ByteTokenizer(), None, **_kw())
    (tmp_path / "e.jsonl").write_text("\n  \n")
    with pytest.raises(DataError, match=r"^no SFT records found in .*e.jsonl") as e:
        build_sft_loader([tmp_path / "e.jsonl"], ByteTokenizer(), None, **_kw())
    assert "\n" not in str(e.value)


# -- truncation, packing, padding --------------------------------------------------------------------
def test_truncation_is_counted_and_answerless_samples_dropped(tmp_path):
    tok = ByteTokenizer()
    head = len("### User:\np\n\n### Assistant:\n")  # 28 bytes
    recs = [{"prompt": "p", "completion": "c" * 5},    # 28 + 5 + EOS = 34 tokens = 33 pairs: fits seq_len 40
            {"prompt": "p", "completion": "c" * 40},   # 69 tokens: cut to 41, keeps 13 answer tokens, no EOS
            {"prompt": "p" * 60, "completion": "c"}]   # cut inside the prompt: no answer left, dropped
    f = _jsonl(tmp_path / "d.jsonl", recs)
    loader, stats = build_sft_loader([f], tok, None, **_kw(seq_len=40))
    assert (stats["records"], stats["samples"], stats["truncated"], stats["dropped"]) == (3, 2, 2, 1)
    rows = _sample_rows(loader)
    assert len(rows[0][0]) == 33 and _loss_ids(rows[0][1]) == [ord("c")] * 5 + [256]
    assert len(rows[1][0]) == 40 and _loss_ids(rows[1][1]) == [ord("c")] * (41 - head)
    assert stats["tokens"] == 34 + 41 and stats["loss_tokens"] == 6 + 13
    with pytest.raises(DataError, match="no SFT sample has an answer token left within data.seq_len"):
        build_sft_loader([f], tok, None, **_kw(seq_len=8))


def _synthetic(n, rng, max_len=20):
    """Samples whose ids encode (sample, position): a leaked label would show in the numbers."""
    out = []
    for s in range(n):
        L = int(rng.integers(3, max_len))
        ids = [1000 * (s + 1) + t for t in range(L)]
        mask = [t >= max(2, L // 2) for t in range(L)]
        out.append((ids, mask))
    return out


def test_pack_and_pad_shapes_and_no_label_crosses_samples():
    rng = np.random.default_rng(0)
    samples = _synthetic(40, rng)
    L = 24
    pad = SFTLoader(samples, L, micro_batch_size=4, grad_accum=2, dp_rank=0, dp_size=1, pack=False, pad_id=7)
    packed = SFTLoader(samples, L, micro_batch_size=4, grad_accum=2, dp_rank=0, dp_size=1, pack=True, pad_id=7)
    assert pad.n_rows == 40 and packed.n_rows < 40 and packed.stats["fill"] > pad.stats["fill"]
    assert pad.stats["loss_tokens"] == packed.stats["loss_tokens"] == sum(sum(m[1:]) for _, m in samples)
    for loader in (pad, packed):
        for x, y in loader.next_step():
            assert x.shape == y.shape == (4, L) and x.dtype == y.dtype == torch_int64()
    # every sample appears exactly once, whole, in one row; between samples and after them nothing leaks
    seen = []
    for w in range(packed.n_rows):
        x, y = packed.row(w)
        pos = 0
        for i in packed.row_samples(w):
            ids, mask = samples[i]
            n = len(ids) - 1
            assert x[pos : pos + n].tolist() == ids[:-1]
            assert y[pos : pos + n].tolist() == [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(n)]
            assert y[pos] == IGNORE_INDEX  # a sample's first label is its own prompt, never the previous answer
            pos += n
            seen.append(i)
        assert (x[pos:] == 7).all() and (y[pos:] == IGNORE_INDEX).all()
        # any label is in the same sample as its input (ids encode the sample in the thousands)
        sel = y != IGNORE_INDEX
        assert (y[sel] // 1000 == x[sel] // 1000).all() and (y[sel] == x[sel] + 1).all()
    assert sorted(seen) == list(range(40))
    for w in range(pad.n_rows):
        assert pad.row_samples(w) == [w]


def test_mark_padding_says_which_tokens_are_padding():
    """For a mixture of experts' router statistics (`mark_padding`): rows carry `real`, True on the samples'
    tokens and False on the padding after them; positions stay in their place (None without document_mask)."""
    import torch

    samples = _synthetic(12, np.random.default_rng(1))
    for document_mask in (False, True):
        loader = SFTLoader(samples, 24, micro_batch_size=3, grad_accum=1, dp_rank=0, dp_size=1, pack=True, pad_id=7,
                           document_mask=document_mask, shuffle=False)
        assert len(loader.rows([0, 1])) == (3 if document_mask else 2)
        loader.mark_padding = True
        ids = list(range(loader.n_rows))
        x, y, positions, real = loader.rows(ids)
        assert (positions is not None) == document_mask and real.dtype == torch.bool and real.shape == x.shape
        for k, w in enumerate(ids):
            n = sum(len(samples[i][0]) - 1 for i in loader.row_samples(w))
            assert real[k, :n].all() and not real[k, n:].any(), (w, n)
        assert not real.all()  # some padding: the check above could fail
        assert (x[~real] == 7).all() and (y[~real] == IGNORE_INDEX).all()


def torch_int64():
    import torch

    return torch.int64


def test_best_fit_packing_is_tight_and_deterministic():
    lengths = [7, 3, 5, 5, 2, 8, 1, 4]
    rows = pack_best_fit(lengths, 10)
    assert rows == pack_best_fit(lengths, 10)
    assert sorted(i for r in rows for i in r) == list(range(8))
    assert all(sum(lengths[i] for i in r) <= 10 for r in rows)
    assert len(rows) == 4  # 35 tokens need at least 4 rows of 10


def test_build_sft_loader_pack_option(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "completion": "a" * i} for i in range(1, 30)])
    packed, s1 = build_sft_loader([f], ByteTokenizer(), None, **_kw(seq_len=64, pack=True))
    padded, s2 = build_sft_loader([f], ByteTokenizer(), None, **_kw(seq_len=64, pack=False))
    assert s2["rows"] == 29 and s1["rows"] < 29 and s1["loss_tokens"] == s2["loss_tokens"]
    assert padded.n_rows == 29 and packed.n_rows == s1["rows"]


# -- global order, dp invariance, resume ------------------------------------------------------------
def _rows_seen(loader, steps):
    out = []
    for _ in range(steps):
        rows = []
        for x, y in loader.next_step():
            rows += [(tuple(a.tolist()), tuple(b.tolist())) for a, b in zip(x, y)]
        out.append(rows)
    return out


@pytest.mark.parametrize("pack", [True, False])
def test_global_batch_is_the_same_whatever_the_ranks(pack):
    samples = _synthetic(90, np.random.default_rng(1))
    kw = dict(seq_len=32, pack=pack, seed=5)
    ref = _rows_seen(SFTLoader(samples, micro_batch_size=4, grad_accum=2, dp_rank=0, dp_size=1, **kw), 5)
    for dp, mbs, accum in ((2, 2, 2), (4, 1, 2), (2, 4, 1), (8, 1, 1)):
        per_rank = [_rows_seen(SFTLoader(samples, micro_batch_size=mbs, grad_accum=accum, dp_rank=r, dp_size=dp,
                                         **kw), 5) for r in range(dp)]
        for step in range(5):
            got = [row for rank in per_rank for row in rank[step]]
            assert sorted(got) == sorted(ref[step]), (dp, mbs, accum, step)


def test_resume_continues_exactly_also_on_another_dp_degree():
    samples = _synthetic(60, np.random.default_rng(2))
    straight = _rows_seen(SFTLoader(samples, 32, 2, 1, 0, 1, seed=3), 12)
    first = SFTLoader(samples, 32, 2, 1, 0, 1, seed=3)
    _rows_seen(first, 4)
    state = first.state_dict()
    assert state == {"samples_seen": 8, "order_version": 2}
    halves = []
    for r in range(2):
        again = SFTLoader(samples, 32, 1, 1, r, 2, seed=3)
        again.load_state_dict(state)
        halves.append(_rows_seen(again, 8))
    for step in range(8):
        assert sorted(halves[0][step] + halves[1][step]) == sorted(straight[4 + step])


def test_epochs_reshuffle_and_cover_every_row():
    samples = _synthetic(10, np.random.default_rng(4))
    loader = SFTLoader(samples, 32, 1, 1, 0, 1, seed=3, pack=False)
    firsts = [loader.next_step()[0][0][0, 0].item() // 1000 for _ in range(20)]
    assert sorted(firsts[:10]) == sorted(firsts[10:]) == list(range(1, 11)) and firsts[:10] != firsts[10:]
    ordered = SFTLoader(samples, 32, 1, 1, 0, 1, shuffle=False, pack=False)
    assert [ordered.next_step()[0][0][0, 0].item() // 1000 for _ in range(10)] == list(range(1, 11))


def test_plain_template_segments_are_documented_format():
    segs = PlainTemplate(eos_id=99).segments([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}])
    assert segs == [("### User:\n", False), ("u\n\n", False), ("### Assistant:\n", False), ("a", True), (99, True)]


LLAMA3 = ("{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
          " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
          "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
           "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
           "{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
QWEN = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.mark.parametrize("template, bos, eos, ends", [
    (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    (MISTRAL, "<s>", "</s>", "</s>"),
    (QWEN, "", "<|im_end|>", "<|im_end|>"),
])
def test_common_template_styles_span_the_answer_and_its_end_marker(tmp_path, template, bos, eos, ends):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": bos,
                                                                "eos_token": eos}))
    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    t = ChatTemplate.from_dir(tmp_path)
    text, spans = t.spans(msgs)
    assert [text[a:b] for a, b in spans] == ["a1" + ends, "a2" + ends]
    # each answer starts right where the inference prompt (add_generation_prompt=True) ends
    assert spans[1][0] == len(t.render(msgs[:3], add_generation_prompt=True))


def test_sft_records_from_parquet_and_zst_equal_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    records = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a" * i}]}
               for i in range(1, 8)]
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (tmp_path / "d.jsonl").write_text(lines)
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet", row_group_size=3)
    rows = {}
    for name in ("d.jsonl", "d.jsonl.zst", "d.parquet"):
        loader, stats = build_sft_loader([tmp_path / name], ByteTokenizer(), None, **_kw())
        assert stats["records"] == 7
        rows[name] = [t.tolist() for t in loader.rows(list(range(loader.n_rows)))]
    assert rows["d.jsonl"] == rows["d.jsonl.zst"] == rows["d.parquet"]
