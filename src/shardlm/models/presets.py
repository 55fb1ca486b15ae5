"""Exact-name table of model shapes. Values follow each model's published HF `config.json`."""

from __future__ import annotations

import difflib

from shardlm.models.llama import ModelConfig, RopeScaling

_LLAMA31 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_LLAMA32 = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def _llama3(dim, n_layers, n_heads, ffn_dim, scaling=_LLAMA31, tie=False) -> ModelConfig:
    return ModelConfig(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, ffn_dim=ffn_dim,
                       vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0, rope_scaling=scaling,
                       max_seq_len=131072, tie_embeddings=tie)


def _llama2(dim, n_layers, n_heads, n_kv_heads, ffn_dim) -> ModelConfig:
    return ModelConfig(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=ffn_dim,
                       vocab_size=32000, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096)


def _qwen2(dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab=152064, tie=False) -> ModelConfig:
    return ModelConfig(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=ffn_dim,
                       vocab_size=vocab, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768,
                       tie_embeddings=tie, qkv_bias=True)


def _qwen3(dim, n_layers, n_heads, ffn_dim, tie=False) -> ModelConfig:
    return ModelConfig(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, head_dim=128, ffn_dim=ffn_dim,
                       vocab_size=151936, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960,
                       tie_embeddings=tie, qk_norm=True)


def _qwen3_moe(dim, n_layers, n_heads, ffn_dim, moe_ffn_dim) -> ModelConfig:
    return ModelConfig(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=4, head_dim=128, ffn_dim=ffn_dim,
                       vocab_size=151936, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, qk_norm=True,
                       n_experts=128, n_experts_per_tok=8, moe_ffn_dim=moe_ffn_dim, norm_topk_prob=True,
                       router_aux_loss_coef=0.001)


def _mixtral(dim, n_layers, n_heads, moe_ffn_dim, max_seq_len, aux) -> ModelConfig:
    return ModelConfig(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, ffn_dim=moe_ffn_dim, vocab_size=32000,
                       norm_eps=1e-5, rope_theta=1000000.0, max_seq_len=max_seq_len, n_experts=8, n_experts_per_tok=2,
                       moe_ffn_dim=moe_ffn_dim, norm_topk_prob=True, router_aux_loss_coef=aux)


PRESETS: dict[str, ModelConfig] = {
    # ~0.9M parameters: trains on a laptop CPU; vocab fits the byte tokenizer (256 bytes + EOS).
    "debug": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=320,
                         rope_theta=10000.0, max_seq_len=512),
    "llama3_1b": _llama3(2048, 16, 32, 8192, scaling=_LLAMA32, tie=True),
    "llama3_3b": _llama3(3072, 28, 24, 8192, scaling=_LLAMA32, tie=True),
    "llama3_8b": _llama3(4096, 32, 32, 14336),
    "llama3_70b": _llama3(8192, 80, 64, 28672),
    "llama3_405b": _llama3(16384, 126, 128, 53248),
    "llama2_7b": _llama2(4096, 32, 32, 32, 11008),
    "llama2_13b": _llama2(5120, 40, 40, 40, 13824),
    "llama2_70b": _llama2(8192, 80, 64, 8, 28672),
    "mistral_7b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32768,
                              norm_eps=1e-5, rope_theta=1000000.0, max_seq_len=32768),
    "qwen2_0_5b": _qwen2(896, 24, 14, 2, 4864, vocab=151936, tie=True),
    "qwen2_7b": _qwen2(3584, 28, 28, 4, 18944),
    "qwen3_0_6b": _qwen3(1024, 28, 16, 3072, tie=True),
    "qwen3_1_7b": _qwen3(2048, 28, 16, 6144, tie=True),
    "qwen3_4b": _qwen3(2560, 36, 32, 9728, tie=True),
    "qwen3_8b": _qwen3(4096, 36, 32, 12288),
    "qwen3_14b": _qwen3(5120, 40, 40, 17408),
    "qwen3_32b": _qwen3(5120, 64, 64, 25600),
    # Mixtures of experts (total / active parameters as published: 30.5B / 3.3B, 235B / 22B, 46.7B / 12.9B,
    # 141B / 39B; tests/unit/models/test_moe.py holds the counts to them).
    "debug_moe": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=320,
                             rope_theta=10000.0, max_seq_len=512, qk_norm=True, n_experts=8, n_experts_per_tok=2,
                             moe_ffn_dim=48, router_aux_loss_coef=0.001),
    "qwen3_30b_a3b": _qwen3_moe(2048, 48, 32, 6144, 768),
    "qwen3_235b_a22b": _qwen3_moe(4096, 94, 64, 12288, 1536),
    "mixtral_8x7b": _mixtral(4096, 32, 32, 14336, 32768, 0.02),
    "mixtral_8x22b": _mixtral(6144, 56, 48, 16384, 65536, 0.001),
}


def get_preset(name: str) -> ModelConfig:
    """The preset called exactly `name`; an unknown name raises KeyError listing the valid ones."""
    try:
        return PRESETS[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(PRESETS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise KeyError(f"unknown model preset {name!r}; {hint}valid presets: {', '.join(PRESETS)}") from None
