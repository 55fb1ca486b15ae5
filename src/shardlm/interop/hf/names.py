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
from dataclasses import dataclass

import torch

from shardlm.models.llama import ModelConfig, Transformer

HF_PREFIX = "model."
HEAD = "lm_head.weight"  # the same name in HF's and our state dicts
EMBED = "embed_tokens.weight"  # ours; HF's is HF_PREFIX + EMBED
_IGNORED_SUFFIX = "rotary_emb.inv_freq"  # a buffer old HF checkpoints saved; recomputed from the config
LORA_RE = re.compile(r"^(?P<mod>.+)\.(?P<ab>lora_[AB])\.weight$")
# LoRA of stacked experts (models.moe.Experts): `X.experts.lora_A.gate_proj` beside the base `X.experts.gate_proj`
EXPERT_LORA_RE = re.compile(r"^(?P<mod>.+\.experts)\.(?P<ab>lora_[AB])\.(?P<proj>\w+)$")


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
        e = EXPERT_LORA_RE.match(n)
        if m:
            lora.setdefault(m["mod"], {})[m["ab"][-1]] = n
        elif e:  # keyed by the base parameter's name, which has no `.weight`
            lora.setdefault(f"{e['mod']}.{e['proj']}", {})[e["ab"][-1]] = n
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


# -- mixtures of experts: our stacked experts <-> HF's per-expert or fused tensors ---------------------------
# Our `layers.N.mlp.experts.{gate,up,down}_proj` are (n_experts, out, in). The published checkpoints hold one
# 2-D tensor per expert and projection (Qwen: `mlp.experts.E.gate_proj.weight`; Mixtral:
# `block_sparse_moe.experts.E.w1.weight`, w3 = up, w2 = down, and its router `block_sparse_moe.gate`); newer
# transformers' in-memory ("fused") layout holds `mlp.experts.gate_up_proj` (n_experts, 2 * ffn, dim), gate rows
# first, and `mlp.experts.down_proj` as ours.
_MIXTRAL_W = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
FUSED_MARK = ".experts.gate_up_proj"


@dataclass(frozen=True)
class Source:
    """Where one of our tensors lives in an HF checkpoint: `names[0]` as it is; with `stacked`, `names[e]` is
    our row e (one tensor per expert); with `dim1 = (lo, hi)`, ours is `names[0][:, lo:hi]` (a half of a fused
    gate_up_proj)."""

    names: tuple[str, ...]
    stacked: bool = False
    dim1: tuple[int, int] | None = None

    def region(self, region: tuple[slice, ...]):
        """[(HF name, region of it, our row or None)] that fill `region` of our tensor."""
        if self.stacked:
            rows, rest = region[0], tuple(region[1:])
            return [(self.names[e], rest, e - rows.start) for e in range(rows.start, rows.stop)]
        if self.dim1 is not None:
            r1 = region[1]
            return [(self.names[0], (region[0], slice(self.dim1[0] + r1.start, self.dim1[0] + r1.stop),
                                     *region[2:]), None)]
        return [(self.names[0], region, None)]


def is_fused_layout(names: Iterable[str]) -> bool:
    """Whether a checkpoint's tensor names are the fused expert layout (else per-expert, or dense)."""
    return any(n.endswith(FUSED_MARK) for n in names)


def hf_sources(cfg: ModelConfig, model_type: str, fused: bool = False) -> dict[str, Source]:
    """Our state-dict name -> its `Source` in an HF checkpoint of `model_type` in the published (per-expert) or
    the fused expert layout. Dense names map one to one (`our_key_to_hf`)."""
    shapes = expected_shapes(cfg)
    out: dict[str, Source] = {}
    mixtral = model_type == "mixtral" and not fused
    for name, shape in shapes.items():
        m = re.fullmatch(r"layers\.(\d+)\.mlp\.(experts\.(\w+)|gate\.weight)", name)
        if m is None:
            out[name] = Source((our_key_to_hf(name),))
            continue
        block = f"{HF_PREFIX}layers.{m[1]}.{'block_sparse_moe' if mixtral else 'mlp'}"
        proj = m[3]
        if proj is None:  # the router
            out[name] = Source((f"{block}.gate.weight",))
        elif fused and proj in ("gate_proj", "up_proj"):
            f = shape[1]
            out[name] = Source((f"{block}.experts.gate_up_proj",), dim1=(0, f) if proj == "gate_proj" else (f, 2 * f))
        elif fused:
            out[name] = Source((f"{block}.experts.{proj}",))
        else:
            w = _MIXTRAL_W[proj] if mixtral else proj
            out[name] = Source(tuple(f"{block}.experts.{e}.{w}.weight" for e in range(shape[0])), stacked=True)
    return out


def hf_shapes(shapes: Mapping[str, Sequence[int]], sources: Mapping[str, Source]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for the checkpoint `sources` describe (`shapes`: ours, by our name)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, src in sources.items():
        shape = shapes[name]
        if src.stacked:
            out.update({n: tuple(shape[1:]) for n in src.names})
        elif src.dim1 is not None:
            out[src.names[0]] = (shape[0], 2 * shape[1], *shape[2:])
        else:
            out[src.names[0]] = tuple(shape)
    return out


def to_hf_tensors(name: str, t: torch.Tensor, src: Source) -> dict[str, torch.Tensor]:
    """Our whole tensor `name` as the HF tensors `src` names (a fused half: only its half, key `name`'s HF
    name with `#gate`/`#up`: `join_fused` puts the two together)."""
    if src.stacked:
        return {n: t[e] for e, n in enumerate(src.names)}
    if src.dim1 is not None:
        return {f"{src.names[0]}#{src.dim1[0]}": t}
    return {src.names[0]: t}


def join_fused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Put the `#lo` halves of `to_hf_tensors` together (gate rows first) where both are present."""
    out = {k: v for k, v in tensors.items() if "#" not in k}
    halves: dict[str, dict[int, torch.Tensor]] = {}
    for k, v in tensors.items():
        if "#" in k:
            base, lo = k.split("#")
            halves.setdefault(base, {})[int(lo)] = v
    for base, hv in halves.items():
        if len(hv) != 2:
            raise ValueError(f"{base}: one half of the fused gate_up_proj is missing")
        out[base] = torch.cat([hv[0], hv[max(hv)]], dim=1)
    return out
