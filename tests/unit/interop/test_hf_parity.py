"""Logit parity with Hugging Face transformers for tiny random Llama / Mistral / Qwen2 / Qwen3 models."""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.hf_tiny import tiny_hf_model  # noqa: E402

from shardlm.interop.hf.config import config_from_hf, config_to_hf  # noqa: E402
from shardlm.interop.hf.names import (  # noqa: E402
    hf_key_to_ours,
    hf_state_dict_to_ours,
    our_key_to_hf,
    our_state_dict_to_hf,
)
from shardlm.models.llama import ModelConfig, RopeScaling, Transformer, rope_inv_freq  # noqa: E402
from shardlm.models.presets import PRESETS  # noqa: E402

TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.1,
)
LLAMA3_SCALING = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32,
)
CASES = {
    "llama3_scaled": ("llama", dict(rope_parameters=dict(LLAMA3_SCALING, rope_theta=500000.0))),
    "llama_tied": ("llama", dict(tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1e4))),
    "mistral": ("mistral", dict(sliding_window=None, rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen2": ("qwen2", dict(rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen3": ("qwen3", dict(head_dim=32, rope_parameters=dict(rope_type="default", rope_theta=1e6))),
}


def _hf_model(name: str):
    """A tiny fp32 HF causal LM with random weights, biases and norm gains."""
    model_type, extra = CASES[name]
    return tiny_hf_model(model_type, **TINY, **extra)


def _ours(cfg: ModelConfig, hf_sd: dict[str, torch.Tensor]) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.load_state_dict(hf_state_dict_to_ours(hf_sd, cfg), strict=True)
    model.rope.reset_parameters()
    return model.eval()


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    hf = _hf_model(request.param)
    cfg = config_from_hf(hf.config.to_dict())
    return request.param, hf, cfg, _ours(cfg, hf.state_dict())


TOKENS = torch.randint(0, TINY["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(1))


def test_logits_match_hf(pair):
    name, hf, cfg, ours = pair
    with torch.no_grad():
        want = hf(input_ids=TOKENS).logits
        got = ours(TOKENS)
    assert got.shape == want.shape == (2, 64, TINY["vocab_size"])
    assert want.abs().max() > 0.1  # not a degenerate model
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5, f"{name}: max |logit diff| {diff:.3g}"


def test_config_mapping(pair):
    name, hf, cfg, _ = pair
    model_type, extra = CASES[name]
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (64, 2, 4, 2)
    assert (cfg.ffn_dim, cfg.vocab_size, cfg.max_seq_len, cfg.norm_eps) == (128, 256, 128, 1e-6)
    assert cfg.rope_theta == extra["rope_parameters"]["rope_theta"]
    assert cfg.head_dim == extra.get("head_dim", 16)
    assert cfg.tie_embeddings == extra.get("tie_word_embeddings", False)
    assert cfg.qkv_bias == (model_type == "qwen2") and cfg.qk_norm == (model_type == "qwen3")
    if name == "llama3_scaled":
        assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32)
    else:
        assert cfg.rope_scaling is None


def test_rope_frequencies_match_hf(pair):
    name, hf, cfg, _ = pair
    torch.testing.assert_close(rope_inv_freq(cfg), hf.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    if name == "llama3_scaled":  # the scaling must actually bite, or the parity test proves nothing about it
        plain = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
        assert (rope_inv_freq(cfg) < plain * 0.99).sum() >= 2


def test_parity_is_sensitive_to_rope_scaling():
    hf = _hf_model("llama3_scaled")
    cfg = config_from_hf(hf.config.to_dict())
    scaled, unscaled = _ours(cfg, hf.state_dict()), _ours(dataclasses.replace(cfg, rope_scaling=None), hf.state_dict())
    with torch.no_grad():
        assert (unscaled(TOKENS) - scaled(TOKENS)).abs().max() > 1e-3


def test_config_round_trip(pair):
    name, hf, cfg, _ = pair
    model_type, _ = CASES[name]
    d = config_to_hf(cfg, model_type)
    assert d["model_type"] == model_type and d["architectures"] == [type(hf).__name__]
    assert config_from_hf(d) == cfg
    src = hf.config.to_dict()
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings"):
        assert d[key] == src[key], key
    assert d["rope_parameters"]["rope_theta"] == src["rope_parameters"]["rope_theta"]
    back = transformers.AutoConfig.for_model(**d)  # transformers accepts what we write
    assert type(back) is type(hf.config)
    assert config_from_hf(back.to_dict()) == cfg


def test_state_dict_round_trip(pair):
    _, hf, cfg, ours = pair
    hf_sd = our_state_dict_to_hf(ours.state_dict(), cfg)
    want = {k: v for k, v in hf.state_dict().items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    assert hf_sd.keys() == want.keys()
    for k, v in hf_sd.items():
        assert torch.equal(v, want[k]), k
    assert all(our_key_to_hf(hf_key_to_ours(k)) == k for k in hf_sd)


def test_auto_model_type():
    assert config_to_hf(PRESETS["qwen3_0_6b"])["model_type"] == "qwen3"
    assert config_to_hf(PRESETS["qwen2_7b"])["model_type"] == "qwen2"
    assert config_to_hf(PRESETS["llama3_8b"])["model_type"] == "llama"


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip(name):
    cfg = PRESETS[name]
    assert config_from_hf(config_to_hf(cfg)) == cfg


def test_legacy_rope_fields():
    d = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             vocab_size=256, rms_norm_eps=1e-5, max_position_embeddings=128, rope_theta=500000.0,
             rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=32))
    cfg = config_from_hf(d, max_seq_len=64)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32)
    assert cfg.max_seq_len == 64 and cfg.n_kv_heads == 4 and cfg.head_dim == 16


@pytest.mark.parametrize("change, words", [
    (dict(model_type="gpt2"), ["model_type", "gpt2", "llama"]),
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)), ["rope_type", "yarn", "llama3"]),
    (dict(model_type="mistral", sliding_window=16), ["sliding_window", "16"]),
    (dict(attention_bias=True), ["attention_bias", "o_proj"]),
    (dict(hidden_act="gelu"), ["hidden_act", "gelu"]),
])
def test_unsupported_config_raises(change, words):
    d = {**TINY, "model_type": "llama", **change}
    with pytest.raises(ValueError) as e:
        config_from_hf(d)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_bad_state_dict_raises(pair):
    _, hf, cfg, _ = pair
    sd = dict(hf.state_dict())
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*shape \(3, 3\)"):
        hf_state_dict_to_ours(sd, cfg)
    sd = dict(hf.state_dict())
    del sd["model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing.*model\.norm\.weight"):
        hf_state_dict_to_ours(sd, cfg)
    sd = dict(hf.state_dict(), **{"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)})
    with pytest.raises(ValueError, match=r"unexpected.*o_proj\.bias"):
        hf_state_dict_to_ours(sd, cfg)
    with pytest.raises(ValueError, match=r"shape"):
        our_state_dict_to_hf({**_ours(cfg, hf.state_dict()).state_dict(), "norm.weight": torch.ones(7)}, cfg)
