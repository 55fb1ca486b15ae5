"""peft's LoRA adapter format: shardlm's adapter weights as peft names them (`adapter_model.safetensors`) and the
`adapter_config.json` that goes with them, both ways. The names map through `interop.hf.names` (our module
names <-> HF's)."""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import torch

from shardlm.interop.hf.names import LORA_RE, hf_key_to_ours, our_key_to_hf

PEFT_PREFIX = "base_model.model."
# peft's live state dict carries the adapter name (`lora_A.default.weight`); saved files do not.
_PEFT = re.compile(r"^(?P<mod>.+)\.(?P<ab>lora_[AB])(?:\.[^.]+)?\.weight$")


def to_peft_state_dict(lora_sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`layers.0.self_attn.q_proj.lora_A.weight` -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    out = {}
    for key, t in lora_sd.items():
        m = LORA_RE.match(key)
        if m is None and ".experts.lora_" in key:
            raise ValueError(f"{key!r} adapts stacked experts, which peft's LoRA format does not hold as shardlm "
                             "trains them; export the model with the adapters merged (--merge-lora)")
        if m is None:
            raise ValueError(f"to_peft_state_dict: {key!r} is not a LoRA weight (only lora_A/lora_B are exported)")
        hf_mod = our_key_to_hf(m["mod"] + ".weight").removesuffix(".weight")  # `lm_head` stays unprefixed
        out[f"{PEFT_PREFIX}{hf_mod}.{m['ab']}.weight"] = t
    return out


def from_peft_state_dict(peft_sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `to_peft_state_dict` (also accepts peft's live names with the adapter name in them).

    `...base_layer.weight` entries are skipped: peft saves the base output head / embedding next to the
    adapter when one is targeted, but the base weights come from the base checkpoint here.
    """
    out = {}
    for key, t in peft_sd.items():
        if ".base_layer." in key:
            continue
        m = _PEFT.match(key.removeprefix(PEFT_PREFIX))
        if not key.startswith(PEFT_PREFIX) or m is None:
            raise ValueError(f"from_peft_state_dict: {key!r} is not a peft LoRA weight "
                             f"('{PEFT_PREFIX}...lora_A.weight' / '...lora_B.weight')")
        ours_mod = hf_key_to_ours(m["mod"] + ".weight").removesuffix(".weight")
        out[f"{ours_mod}.{m['ab']}.weight"] = t
    return out


def peft_adapter_config(rank: int, alpha: float, dropout: float, targets: Iterable[str],
                        base_model_name_or_path: str = "") -> dict[str, Any]:
    """adapter_config.json content for the adapter `to_peft_state_dict` writes (peft LoraConfig fields)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None,
        "revision": None,
        "inference_mode": True,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(set(targets)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
