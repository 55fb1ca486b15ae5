"""HF `config.json` <-> our `ModelConfig` (Llama 2/3/3.1/3.2, Mistral, Qwen2, Qwen3; Qwen3-MoE, Mixtral, Qwen2-MoE).

`config_from_hf` / `config_to_hf` work on dicts and raise ValueError; `read_hf_config` reads a folder's
config.json and turns every problem into one ConfigError line naming the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardlm.errors import ConfigError
from shardlm.models.llama import ModelConfig, RopeScaling

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
MOE_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe")


def _req(hf: Mapping[str, Any], key: str) -> Any:
    """hf[key], or a ValueError naming the missing field."""
    if hf.get(key) is None:
        raise ValueError(f"HF config: required field {key!r} is missing")
    return hf[key]


def _rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers-5 `rope_parameters` or the older `rope_theta`/`rope_scaling`."""
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if any(isinstance(v, Mapping) for v in rp.values()):
        raise ValueError("HF config: per-layer-type 'rope_parameters' are not supported; use one RoPE for all layers")
    theta = float(rp.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("HF config: 'partial_rotary_factor' must be 1.0 (RoPE on the whole head)")
    kind = rp.get("rope_type", rp.get("type")) or "default"
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"HF config: rope_type {kind!r} is not supported; supported: 'default' and 'llama3'")
    return theta, RopeScaling(
        factor=float(rp["factor"]),
        low_freq_factor=float(rp["low_freq_factor"]),
        high_freq_factor=float(rp["high_freq_factor"]),
        original_max_position_embeddings=int(
            rp.get("original_max_position_embeddings") or _req(hf, "max_position_embeddings")
        ),
    )


def config_from_hf(hf: Mapping[str, Any], max_seq_len: int | None = None) -> ModelConfig:
    """Our ModelConfig from an HF `config.json` dict (llama / mistral / qwen2 / qwen3)."""
    mt = hf.get("model_type")
    if mt not in ARCHITECTURES:
        raise ValueError(f"HF config: model_type {mt!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    archs = hf.get("architectures") or []
    if any(a != ARCHITECTURES[mt] for a in archs):
        raise ValueError(f"HF config: architectures {archs} not supported for {mt!r}; expected {ARCHITECTURES[mt]!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"HF config: hidden_act {hf['hidden_act']!r} is not supported; only 'silu' (SwiGLU)")
    if hf.get("mlp_bias"):
        raise ValueError("HF config: 'mlp_bias' = true is not supported (our MLP has no biases)")
    if hf.get("attention_bias") and mt in ("llama", "qwen3", "qwen3_moe"):
        # HF Llama/Qwen3 put this bias on o_proj as well as q/k/v; our o_proj has none.
        raise ValueError(f"HF config: 'attention_bias' = true is not supported for {mt!r} (it adds an o_proj bias)")
    if max_seq_len is None:
        max_seq_len = int(_req(hf, "max_position_embeddings"))
    window = hf.get("sliding_window") if mt in ("mistral", "mixtral") or hf.get("use_sliding_window") else None
    if window is not None and window < max_seq_len:
        raise ValueError(
            f"HF config: 'sliding_window' = {window} < max_seq_len {max_seq_len} is not supported (full causal "
            "attention only); pass max_seq_len <= sliding_window"
        )
    theta, scaling = _rope(hf)
    n_heads = int(_req(hf, "num_attention_heads"))
    return ModelConfig(
        dim=int(_req(hf, "hidden_size")),
        n_layers=int(_req(hf, "num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=hf.get("head_dim"),
        vocab_size=int(_req(hf, "vocab_size")),
        ffn_dim=int(_req(hf, "intermediate_size")),
        norm_eps=float(_req(hf, "rms_norm_eps")),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=max_seq_len,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=mt in ("qwen2", "qwen2_moe"),
        qk_norm=mt in ("qwen3", "qwen3_moe"),
        **(_moe_from_hf(hf, mt) if mt in MOE_TYPES else {}),
    )


def _moe_from_hf(hf: Mapping[str, Any], mt: str) -> dict[str, Any]:
    """The mixture-of-experts fields of ModelConfig from a qwen3_moe / qwen2_moe / mixtral config.json."""
    if float(hf.get("router_jitter_noise") or 0.0):
        raise ValueError("HF config: 'router_jitter_noise' > 0 is not supported (routing is deterministic); set it to 0")
    # The coefficient HF's trainer applies when output_router_logits is on (published configs leave it off for
    # inference; fine-tuning recipes turn it on): ours applies it whenever it trains (model.router_aux_loss_coef=0: off).
    coef = float(hf.get("router_aux_loss_coef") or 0.0)
    if mt == "mixtral":
        return dict(n_experts=int(_req(hf, "num_local_experts")), n_experts_per_tok=int(_req(hf, "num_experts_per_tok")),
                    moe_ffn_dim=int(_req(hf, "intermediate_size")), norm_topk_prob=True, router_aux_loss_coef=coef)
    n_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if n_experts is None:
        raise ValueError("HF config: required field 'num_experts' is missing")
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if mt == "qwen2_moe" else 0
    return dict(n_experts=int(n_experts), n_experts_per_tok=int(_req(hf, "num_experts_per_tok")),
                moe_ffn_dim=int(_req(hf, "moe_intermediate_size")),
                norm_topk_prob=bool(hf.get("norm_topk_prob", mt == "qwen3_moe")),
                moe_layer_step=int(hf.get("decoder_sparse_step") or 1),
                dense_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
                shared_expert_ffn_dim=shared, router_aux_loss_coef=coef)


def default_model_type(cfg: ModelConfig) -> str:
    """The HF model_type that represents `cfg`: qwen3(_moe) if qk_norm, qwen2(_moe) if qkv_bias, else llama or,
    with experts, mixtral."""
    if cfg.n_experts:
        return "qwen3_moe" if cfg.qk_norm else "qwen2_moe" if cfg.qkv_bias else "mixtral"
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def _moe_to_hf(cfg: ModelConfig, mt: str) -> dict[str, Any]:
    if mt == "mixtral":
        if cfg.dense_layers or cfg.moe_layer_step != 1 or not cfg.norm_topk_prob or cfg.shared_expert_ffn_dim:
            raise ValueError("model_type 'mixtral' has every layer sparse, renormalised top-k and no shared expert; "
                             "this model differs: export it as qwen3_moe or qwen2_moe")
        return {"num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.n_experts_per_tok,
                "intermediate_size": cfg.moe_ffn_dim, "router_aux_loss_coef": cfg.router_aux_loss_coef,
                "router_jitter_noise": 0.0, "output_router_logits": False}
    if cfg.shared_expert_ffn_dim and mt != "qwen2_moe":
        raise ValueError(f"model_type {mt!r} has no shared expert; a model with one exports as qwen2_moe")
    d = {"num_experts": cfg.n_experts, "num_experts_per_tok": cfg.n_experts_per_tok,
         "moe_intermediate_size": cfg.moe_ffn_dim, "norm_topk_prob": cfg.norm_topk_prob,
         "decoder_sparse_step": cfg.moe_layer_step, "mlp_only_layers": list(cfg.dense_layers),
         "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False}
    if mt == "qwen2_moe":
        d["shared_expert_intermediate_size"] = cfg.shared_expert_ffn_dim
    return d


def config_to_hf(cfg: ModelConfig, model_type: str | None = None) -> dict[str, Any]:
    """An HF `config.json` dict for `cfg` (model_type: `default_model_type(cfg)` unless given)."""
    mt = model_type or default_model_type(cfg)
    if mt not in ARCHITECTURES:
        raise ValueError(f"model_type {mt!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    if cfg.qkv_bias != (mt in ("qwen2", "qwen2_moe")) or cfg.qk_norm != (mt in ("qwen3", "qwen3_moe")):
        raise ValueError(
            f"model_type {mt!r} cannot represent qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm} "
            "(qkv_bias needs 'qwen2' or 'qwen2_moe', qk_norm needs 'qwen3' or 'qwen3_moe')"
        )
    if bool(cfg.n_experts) != (mt in MOE_TYPES):
        raise ValueError(f"model_type {mt!r} cannot represent a model with {cfg.n_experts} experts; use "
                         f"{default_model_type(cfg)!r}")
    s = cfg.rope_scaling
    scaling = None if s is None else {
        "rope_type": "llama3",
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position_embeddings,
    }
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[mt]],
        "model_type": mt,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings,
        # Both spellings: transformers 5 reads `rope_parameters`, 4.x reads `rope_theta`/`rope_scaling`.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": cfg.rope_theta},
        "torch_dtype": "float32",
    }
    if mt in ("llama", "qwen3", "qwen3_moe"):
        d["attention_bias"] = False
    if mt == "llama":
        d["mlp_bias"] = False
    if mt in ("mistral", "mixtral"):
        d["sliding_window"] = None
    if mt in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        d.update(use_sliding_window=False, sliding_window=None)
    if mt in MOE_TYPES:
        d.update(_moe_to_hf(cfg, mt))
    return d


def read_hf_config(hf_dir: str | os.PathLike, max_seq_len: int | None = None) -> tuple[ModelConfig, dict]:
    """(our ModelConfig, the raw config.json dict) for an HF model folder; ConfigError if unusable."""
    d = Path(hf_dir)
    if not d.is_dir():
        raise ConfigError(f"HF model folder {str(d)!r} does not exist; pass a folder holding config.json and "
                          "*.safetensors (a local copy: nothing is downloaded)")
    path = d / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: {str(d)!r} is not an HF model folder (it needs config.json)")
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    try:
        return config_from_hf(hf, max_seq_len=max_seq_len), hf
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
