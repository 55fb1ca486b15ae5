"""Decoding: the KV cache equals recomputing everything (fp32, every step, GQA + qk_norm, left padding), greedy
equals `transformers`' greedy `generate` token for token (tiny Llama, Qwen2, Qwen3; from the HF folder and from
a DCP checkpoint), seeded sampling is reproducible, and top-k / top-p are `transformers`' warpers. Rows stop at
the context (one warning line beforehand; a prompt that fills it is a ConfigError), tokens are handed out as they
are chosen, and `TextStream` turns them into text pieces that join up to the whole text."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardlm.data.tokenizer import ByteTokenizer
from shardlm.errors import ConfigError
from shardlm.generate import (
    Completion,
    Sampling,
    TextStream,
    check_context,
    encode_prompt,
    generate,
    generate_batch,
    top_k_filter,
    top_p_filter,
)
from shardlm.models.llama import ModelConfig, Transformer

GQA = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=61, max_seq_len=64,
                  qk_norm=True, qkv_bias=True)
MHA_TIED = dataclasses.replace(GQA, n_kv_heads=4, qk_norm=False, qkv_bias=False, tie_embeddings=True)
TOL = {"rtol": 0, "atol": 1e-5}


def _model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A random fp32 model whose norm gains and biases are not their defaults (ones, zeros)."""
    model = Transformer(cfg)
    model.init_weights(seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
            else:
                p.mul_(5.0)  # larger weights: peaked logits, so greedy is far from ties
    return model.eval()


@pytest.mark.parametrize("cfg", [GQA, MHA_TIED], ids=["gqa_qk_norm_bias", "mha_tied"])
def test_kv_cache_logits_equal_full_recompute_at_every_step(cfg):
    model = _model(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache(2, 24)
        got = [model(x[:, :6], cache=cache), model(x[:, 6:9], cache=cache)]  # prefill, then a chunk after it
        got += [model(x[:, t:t + 1], cache=cache) for t in range(9, 24)]  # one token a step
        assert cache.length == 24
        torch.testing.assert_close(torch.cat(got, 1), full, **TOL)
        last = model(x[:, :10], cache=model.new_cache(2, 12), last_only=True)
    torch.testing.assert_close(last, full[:, 9:10], **TOL)
    assert full.abs().max() > 1.0  # not a degenerate model


def test_left_padded_rows_equal_each_row_alone():
    model = _model(GQA)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 61, (n,), generator=g) for n in (9, 4, 1)]
    steps = torch.randint(0, 61, (3, 5), generator=g)  # five decode steps after the prompts
    width = 9
    tokens = torch.stack([torch.cat([torch.full((width - len(r),), 7), r]) for r in rows])
    pad = torch.tensor([width - len(r) for r in rows])
    with torch.no_grad():
        cache = model.new_cache(3, width + 5, pad)
        got = [model(tokens, cache=cache)] + [model(steps[:, i:i + 1], cache=cache) for i in range(5)]
        got = torch.cat(got, 1)
        for b, r in enumerate(rows):
            alone = model(torch.cat([r, steps[b]])[None])[0]
            torch.testing.assert_close(got[b, pad[b]:], alone, **TOL)
    assert torch.isfinite(got).all()  # padding never leaves an empty attention row (NaN)


def test_kv_cache_misuse_is_one_clear_error():
    model = _model(GQA)
    x = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="no room for 4 more"):
        model(x, cache=model.new_cache(1, 3))
    with pytest.raises(ValueError, match="positions come from the KV cache"):
        model(x, torch.arange(4)[None], cache=model.new_cache(1, 8))
    with pytest.raises(ValueError, match="1 rows but the KV cache 2"):
        model(x, cache=model.new_cache(2, 8))


PROMPTS = [[5, 9, 2, 33, 7, 1, 18, 40], [3], [11, 12, 13, 14]]


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.9, top_k=20, top_p=0.9, seed=3)],
                         ids=["greedy", "sampled"])
def test_cache_decoding_equals_recompute_decoding(sampling):
    model = _model(GQA)
    cached = generate_batch(model, PROMPTS, 20, sampling=sampling)
    assert [c.ids for c in generate_batch(model, PROMPTS, 20, sampling=sampling, use_cache=False)] == \
        [c.ids for c in cached]
    assert [len(c.ids) for c in cached] == [20, 20, 20] and all(c.finish == "length" for c in cached)
    # one prompt at a time, or two per batch: the same ids (padding is exact, each prompt has its own generator)
    assert [c.ids for c in generate_batch(model, PROMPTS, 20, sampling=sampling, batch_size=1)] == \
        [c.ids for c in cached]
    assert [c.ids for c in generate_batch(model, PROMPTS, 20, sampling=sampling, batch_size=2)] == \
        [c.ids for c in cached]
    # rows stop at the context (8 + 4, 1 + 11, 4 + 8 tokens), the cache as the recomputation, each row as it began
    short = generate_batch(model, PROMPTS, 20, sampling=sampling, context=12)
    assert [c.ids for c in short] == [c.ids for c in generate_batch(model, PROMPTS, 20, sampling=sampling,
                                                                     context=12, use_cache=False)]
    assert [c.ids for c in short] == [c.ids[:n] for c, n in zip(cached, (4, 11, 8))]
    assert all(c.finish == "context" for c in short)


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    model = _model(GQA)
    s = Sampling(temperature=1.0, seed=7)
    a = generate_batch(model, PROMPTS, 16, sampling=s)
    assert [c.ids for c in a] == [c.ids for c in generate_batch(model, PROMPTS, 16, sampling=s)]
    other = generate_batch(model, PROMPTS, 16, sampling=dataclasses.replace(s, seed=8))
    assert all(x.ids != y.ids for x, y in zip(a, other))
    greedy = generate_batch(model, PROMPTS, 16)
    assert [c.ids for c in generate_batch(model, PROMPTS, 16, sampling=Sampling(temperature=1.0, top_k=1))] == \
        [c.ids for c in greedy]
    assert [c.ids for c in a] != [c.ids for c in greedy]
    # the end-of-training sample's call: prompt + new ids, deterministic per seed
    one = generate(model, [1, 2, 3], 10, 16, seed=5)
    assert one == generate(model, [1, 2, 3], 10, 16, seed=5) and len(one) == 13 and one[:3] == [1, 2, 3]


def test_rows_stop_at_the_models_context_and_a_prompt_that_fills_it_is_one_error():
    model = _model(GQA)  # RoPE table: 64 positions
    free = generate_batch(model, PROMPTS, 20)
    (c,) = generate_batch(model, [PROMPTS[0]], 4, context=12)  # 8 + 4 fits exactly: it ran to max_new_tokens
    assert c.ids == free[0].ids[:4] and c.finish == "length"
    (c,) = generate_batch(model, [[1, 2] * 30], 100_000_000)  # default: the model's 64 positions, not past them
    assert len(c.ids) == 4 and c.finish == "context"
    assert len(generate(model, [1, 2, 3], 100, 16)) == 16  # the end-of-training sample: prompt + new <= context
    with pytest.raises(ConfigError, match="prompt 2 has 12 tokens and the model's context is 12: no room"):
        generate_batch(model, [[1], [1] * 12], 3, context=12)
    with pytest.raises(ConfigError, match="the prompt has 70 tokens and the model's context is 64"):
        generate(model, [1] * 70, 3)
    with pytest.raises(ValueError, match=r"context must be in \[1, 64\] \(the model's RoPE table\), got 65"):
        generate_batch(model, [[1]], 3, context=65)


def test_the_context_warning_names_both_numbers_and_the_fit():
    assert check_context([[0] * 12], 100_000_000, 2048, "--max-new-tokens") == (
        "--max-new-tokens 100000000 runs past the model's context of 2048 tokens (prompt 12): stopping at 2036 new "
        "tokens; ask for at most 2036 to fit")
    assert check_context([[0] * 12], 2036, 2048) is None
    assert check_context([[0] * 5, [0] * 40, [0] * 2], 20, 50) == (
        "max_new_tokens 20 runs past the model's context of 50 tokens (1 of 3 prompts, the longest 40): they stop "
        "there (10 new tokens for the longest); ask for at most 10 to fit")


def test_each_token_is_handed_out_as_it_is_chosen():
    model = _model(GQA)
    seen: list[tuple[int, int]] = []
    stop = generate_batch(model, PROMPTS, 6)[1].ids[2]
    got = generate_batch(model, PROMPTS, 6, batch_size=2, stop_ids=[stop], on_token=lambda i, t: seen.append((i, t)))
    assert [[t for j, t in seen if j == i] for i in range(3)] == [c.ids for c in got]  # a stopped row: no more
    assert got[1].finish == "stop" and len(got[1].ids) <= 3 and len(seen) == sum(len(c.ids) for c in got)

    def stop_early(i: int, t: int) -> None:  # what Ctrl-C does inside the callback: decoding ends there
        raise KeyboardInterrupt

    model.train()
    with pytest.raises(KeyboardInterrupt):
        generate_batch(model, PROMPTS, 6, on_token=stop_early)
    assert model.training  # put back as it was


def test_text_stream_prints_whole_characters_and_joins_up_to_the_text():
    tok = ByteTokenizer()
    text = "aé€😀 b"
    stream = TextStream(tok, skip=[tok.eos_id])
    pieces = [stream.push(b) for b in [*text.encode(), tok.eos_id]]
    assert "".join(pieces) + stream.flush() == text and not any("\ufffd" in p for p in pieces)
    assert pieces[:3] == ["a", "", "é"]  # é's first byte alone is not a character yet
    cut = list("a€".encode())[:-1]  # the text ends inside a character: flush gives what decoding all of it gives
    stream = TextStream(tok)
    assert "".join(stream.push(b) for b in cut) + stream.flush() == tok.decode(cut)

    class Sentencepiece:  # "▁" is a space, and a text's first space is dropped
        vocab = ("▁Hello", "▁wor", "ld", "!")

        def decode(self, ids: list[int]) -> str:
            return "".join(self.vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")

    stream = TextStream(Sentencepiece())
    assert [stream.push(i) for i in range(4)] == ["Hello", " wor", "ld", "!"]  # decoding one id at a time: "Hellowor"


def test_stop_ids_end_a_row_and_keep_the_stop_token():
    model = _model(GQA)
    free = generate_batch(model, PROMPTS, 12)
    stop = free[0].ids[3]
    got = generate_batch(model, PROMPTS, 12, stop_ids=[stop])
    first = free[0].ids.index(stop)
    assert got[0].ids == free[0].ids[:first + 1] and got[0].finish == "stop"
    assert got[0].text_ids == free[0].ids[:first]
    for g, f in zip(got[1:], free[1:]):  # the other rows go on (unless they meet it too)
        assert g.ids == (f.ids[:f.ids.index(stop) + 1] if stop in f.ids else f.ids)
    assert generate_batch(model, [[1]], 0) == [Completion(prompt=[1])]
    with pytest.raises(ValueError, match="at least one prompt token"):
        generate_batch(model, [[1], []], 3)


def test_top_k_and_top_p_are_transformers_warpers():
    lp = pytest.importorskip("transformers.generation.logits_process")
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    logits[1, :5] = 2.0  # ties
    for k in (1, 2, 5, 49, 50):
        torch.testing.assert_close(top_k_filter(logits, k), lp.TopKLogitsWarper(k)(None, logits.clone()))
    for p in (0.05, 0.3, 0.9, 0.999):
        torch.testing.assert_close(top_p_filter(logits, p), lp.TopPLogitsWarper(p)(None, logits.clone()))
    assert top_k_filter(logits, 0) is logits and top_p_filter(logits, 1.0) is logits
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=0.0)
    for t in (-1.0, float("inf"), float("nan")):  # -1 used to mean greedy, silently
        with pytest.raises(ValueError, match="temperature >= 0"):
            Sampling(temperature=t)


def test_prompts_are_encoded_as_in_training():
    from shardlm.data.sft import ChatTemplate
    from shardlm.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    assert encode_prompt(tok, "ab") == [97, 98] and encode_prompt(tok, "") == [256]
    template = ChatTemplate("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert encode_prompt(tok, "hi", template) == list(b"<user>hi<assistant>")
    plain = encode_prompt(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                {"role": "user", "content": "?"}])
    assert plain == list(b"### User:\nhi\n\n### Assistant:\nyo") + [256] + list(b"### User:\n?\n\n### Assistant:\n")


# -- parity with transformers -------------------------------------------------------------------------
HF_TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
           "initializer_range": 0.3}
ARCHS = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 32}}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_equals_transformers_generate_from_hf_and_from_dcp(arch, tmp_path):
    pytest.importorskip("transformers")
    from helpers.hf_tiny import tiny_hf_model

    from shardlm.inference import load_for_inference
    from shardlm.interop.hf.import_ import import_hf_to_dcp

    hf = tiny_hf_model(arch, **HF_TINY, **ARCHS[arch])
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    import_hf_to_dcp(tmp_path / "hf", tmp_path / "ck")
    prompts = [[5, 9, 2, 33, 7, 1, 18, 40, 250, 3, 77], [3], [11, 12, 13, 14, 15]]
    n = 24
    for source in ({"hf": tmp_path / "hf"}, {"checkpoint": tmp_path / "ck"}):
        inf = load_for_inference(**source, tokenizer="bytes")
        assert inf.context == 64 and inf.precision == "fp32" and not inf.owns_process_group
        got = generate_batch(inf.model, prompts, n, stop_ids=inf.stop_ids, context=inf.context)
        for p, c in zip(prompts, got):
            with torch.no_grad():
                want = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                                   eos_token_id=list(inf.stop_ids), pad_token_id=0)[0, len(p):].tolist()
            assert c.ids == want, (arch, source, p)
        assert len({tuple(c.ids) for c in got}) == 3 and max(len(c.ids) for c in got) == n


def test_a_context_parallel_config_is_refused_for_generation_in_one_line():
    """A training config with parallel.cp reused for generate/eval: one ConfigError, before anything is read."""
    from shardlm.config import load_config
    from shardlm.inference import load_for_inference

    with pytest.raises(ConfigError, match="parallel.cp=2 is a training layout") as e:
        load_for_inference(hf="/nonexistent", cfg=load_config(None, ["--parallel.cp=2"]))
    assert "\n" not in str(e.value)
