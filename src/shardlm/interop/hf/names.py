"""Tensor names: ours <-> HF's, the names and shapes a config implies, and the one validator.

Our names are HF's without the leading `model.` (`lm_head.weight` is the same in both). LoRA adapters
are `X.lora_A.weight` / `X.lora_B.weight` next to the base `X.weight` (`LORA_RE`, used by the peft format
in shardlm.interop.peft too).

`validate(stored, expected, tied)` is the one check of a set of stored tensors against what a model
needs; the HF load, the HF import, the DCP export and the state-dict converters all call it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import torch

from shardlm.models.llama import ModelConfig, Transformer

HF_PREFIX = "model."
HEAD = "lm_head.weight"  # the same name in HF's and our state dicts
EMBED = "embed_tokens.weight"  # ours; HF's is HF_PREFIX + EMBED
_IGNORED_SUFFIX = "rotary_emb.inv_freq"  # a buffer old HF checkpoints saved; recomputed from the config
LORA_RE = re.compile(r"^(?P<mod>.+)\.(?P<ab>lora_[AB])\.weight$")


def hf_key_to_ours(key: str) -> str:
    """HF tensor name -> ours: strip the leading `model.` (`lm_head.weight` is unchanged)."""
    if key == HEAD:
        return key
    if not key.startswith(HF_PREFIX):
        raise ValueError(f"unexpected HF tensor {key!r}: expected 'lm_head.weight' or a name starting with 'model.'")
    return key[len(HF_PREFIX):]


def our_key_to_hf(key: str) -> str:
    """Our tensor name -> HF's: prepend `model.` (`lm_head.weight` is unchanged)."""
    return key if key == HEAD else HF_PREFIX + key


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our state-dict names and shapes for `cfg` (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def natural_key(key: str) -> list:
    """Sort key: embed, layers in numeric order, norm, head (the order HF writes them in)."""
    rank = 0 if "embed_tokens" in key else 2 if key.startswith("norm.") else 3 if key.startswith("lm_head") else 1
    return [rank] + [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def split_lora(names: Iterable[str]) -> tuple[list[str], dict[str, dict[str, str]]]:
    """(base names, {module: {"A": name, "B": name}}) for `X.lora_A.weight` / `X.lora_B.weight` names.

    ValueError when an adapter has only one of its two factors.
    """
    base, lora = [], {}
    for n in names:
        m = LORA_RE.match(n)
        if m:
            lora.setdefault(m["mod"], {})[m["ab"][-1]] = n
        else:
            base.append(n)
    for mod, ab in lora.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA module {mod!r} has lora_{next(iter(ab))} but not its pair")
    return base, lora


def _list(names: list[str]) -> str:
    more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
    return ", ".join(names[:5]) + more


def validate(stored: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]], tied: bool,
             against: str = "the model config") -> dict[str, str]:
    """Check stored tensors (name -> shape) against the ones a model needs; ValueError naming the first
    problem: a missing tensor, an unexpected one, or a wrong shape (`against` names what was expected).

    Works in either namespace (ours or HF's), as long as both mappings use the same one. `tied`: the
    source may duplicate the embedding as `lm_head.weight` (HF's convention); that head is ignored,
    and feeds the embedding when the embedding itself is absent. Buffers named `*rotary_emb.inv_freq`
    are ignored. Returns expected name -> stored name to read it from.
    """
    source = {k: k for k in expected}
    embed = next((k for k in expected if k == EMBED or k == HF_PREFIX + EMBED), None)
    if tied and embed is not None and embed not in stored and HEAD in stored:
        source[embed] = HEAD
    missing = [k for k, s in source.items() if s not in stored]
    if missing:
        raise ValueError(f"missing tensor(s) {_list(missing)}: the weights do not match {against}")
    used = set(source.values())
    for key in stored:
        if key in used or key.endswith(_IGNORED_SUFFIX) or (tied and key == HEAD):
            continue
        raise ValueError(f"unexpected tensor {key!r}: {against} has no such parameter")
    for key, src in source.items():
        if tuple(stored[src]) != tuple(expected[key]):
            raise ValueError(f"tensor {src!r} has shape {tuple(stored[src])}, expected {tuple(expected[key])} "
                             f"(from {against})")
    return source


def hf_state_dict_to_ours(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """An HF state dict renamed to ours, checked against `Transformer(cfg)`'s names and shapes."""
    want = {our_key_to_hf(k): v for k, v in expected_shapes(cfg).items()}
    source = validate({k: t.shape for k, t in sd.items()}, want, cfg.tie_embeddings)
    return {hf_key_to_ours(k): sd[src] for k, src in source.items()}


def our_state_dict_to_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict, checked against `Transformer(cfg)`, renamed to HF's (no `lm_head.weight` when tied)."""
    source = validate({k: t.shape for k, t in sd.items()}, expected_shapes(cfg), cfg.tie_embeddings)
    return {our_key_to_hf(k): sd[src] for k, src in source.items()}
