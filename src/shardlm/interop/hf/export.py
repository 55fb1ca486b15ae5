"""One of our DCP checkpoints -> an HF model folder (or a peft adapter), offline, in bounded memory.

The pieces, each testable with plain inputs:
  plan_shards(sizes, max_bytes)   which tensors go in which output file (pure)
  iter_hf_tensors(reader, ...)    one output shard's tensors, read and converted one read batch at a time
  write_hf_folder(out, ...)       the safetensors files, the index, config.json and the tokenizer
  export_hf(...)                  the three in sequence, with the name/shape/LoRA checks first
  export_checkpoint(...)          `shardlm convert dcp-to-hf`: the policy (the checkpoint's own sidecar
                                  files, adapters-only checkpoints, the base's context length, tokenizer)
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from shardlm.checkpoint.manager import METADATA
from shardlm.checkpoint.meta import CheckpointMeta, tokenizer_dir_of
from shardlm.checkpoint.reader import CheckpointReader
from shardlm.config import LoraSection
from shardlm.errors import ConfigError
from shardlm.interop.hf.config import config_to_hf
from shardlm.interop.hf.load import INDEX_FILE, SINGLE_FILE
from shardlm.interop.hf.names import (
    expected_shapes,
    natural_key,
    our_key_to_hf,
    split_lora,
    validate,
)
from shardlm.lora import peft_adapter_config, to_peft_state_dict
from shardlm.models.llama import ModelConfig

OUT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
READ_BATCH_BYTES = 256 * 2**20  # checkpoint bytes read per dcp.load call (one tensor if larger)

LoraPairs = Mapping[str, Mapping[str, str]]  # base weight name -> {"A": lora_A name, "B": lora_B name}


def _out_dtype(dtype: str) -> torch.dtype:
    if dtype not in OUT_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {', '.join(OUT_DTYPES)}")
    return OUT_DTYPES[dtype]


# -- the pieces ------------------------------------------------------------------------------------
def plan_shards(sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    """Group names (in the given order) into consecutive shards of at most `max_bytes` each; a tensor
    bigger than that gets a shard of its own."""
    shards: list[list[str]] = []
    used = 0
    for name, size in sizes.items():
        if shards and used + size <= max_bytes:
            shards[-1].append(name)
            used += size
        else:
            shards.append([name])
            used = size
    return shards


def iter_hf_tensors(reader: CheckpointReader, shard: Iterable[str], lora: LoraPairs, scaling: float,
                    dtype: torch.dtype, batch_bytes: int = READ_BATCH_BYTES) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors of one output shard (our names in, HF names out), one checkpoint read at a time.

    Each read is at most `batch_bytes` of checkpoint tensors (or one bigger tensor); every yield holds
    the weights that read completed, converted to `dtype`, with `W += B @ A * scaling` for the names in
    `lora`. A weight whose adapter factors are in a later read waits for them. Nothing else is kept.
    """
    shard = list(shard)
    needed = []
    for n in shard:
        needed.append(n)
        if n in lora:
            needed += [lora[n]["A"], lora[n]["B"]]
    loaded: dict[str, torch.Tensor] = {}
    pending = list(shard)
    for batch in reader.batches(needed, batch_bytes):
        loaded.update(reader.read(batch))
        done: dict[str, torch.Tensor] = {}
        for n in pending:
            ab = lora.get(n)
            if n not in loaded or (ab and not (ab["A"] in loaded and ab["B"] in loaded)):
                continue
            w = loaded.pop(n)
            if ab:
                a, b = loaded.pop(ab["A"]).float(), loaded.pop(ab["B"]).float()
                w = w.float() + (b @ a) * scaling
            done[our_key_to_hf(n)] = w.to(dtype).contiguous()
        pending = [n for n in pending if our_key_to_hf(n) not in done]
        yield done


def _shard_name(i: int, n: int) -> str:
    return SINGLE_FILE if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"


def _copy_tokenizer(tokenizer_dir: str | os.PathLike | None, out: Path) -> list[str]:
    if tokenizer_dir is None:
        return []
    src = Path(tokenizer_dir)
    copied = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    if not copied:
        raise ConfigError(f"tokenizer folder {str(src)!r} holds none of {', '.join(TOKENIZER_FILES[:3])}")
    for n in copied:
        shutil.copyfile(src / n, out / n)
    return copied


def write_hf_folder(out: str | os.PathLike, shards: list[Iterable[dict[str, torch.Tensor]]],
                    hf_cfg: Mapping[str, Any], tokenizer_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Write `shards` (each an iterable of tensor batches, consumed one shard at a time) as
    `model.safetensors` or `model-0000i-of-0000n.safetensors` + the index, then config.json and the
    tokenizer files. Existing `model*.safetensors` and the index in `out` are replaced.
    Returns {"files", "weight_map", "total_size"}.
    """
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
        old.unlink(missing_ok=True)  # a previous export's shards would mix in
    weight_map: dict[str, str] = {}
    files, total = [], 0
    for i, batches in enumerate(shards, start=1):
        fname = _shard_name(i, len(shards))
        tensors: dict[str, torch.Tensor] = {}
        for batch in batches:
            tensors.update(batch)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        files.append(fname)
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    _copy_tokenizer(tokenizer_dir, out)
    return {"files": files, "weight_map": weight_map, "total_size": total}


def _check_lora(pairs: LoraPairs, reader: CheckpointReader, expected: Mapping[str, tuple[int, ...]]) -> None:
    for w, ab in pairs.items():
        if w not in expected:
            raise ConfigError(f"{reader.path}: LoRA adapter on {w!r}, which the model does not have")
        a, b = reader.tensors[ab["A"]].shape, reader.tensors[ab["B"]].shape
        o, i = expected[w]
        if len(a) != 2 or len(b) != 2 or a[1] != i or b[0] != o or a[0] != b[1]:
            raise ConfigError(f"{reader.path}: LoRA shapes A {a}, B {b} do not fit {w!r} of shape {(o, i)}")


def _lora_pairs(reader: CheckpointReader) -> tuple[list[str], dict[str, dict[str, str]]]:
    try:
        base, pairs = split_lora(reader.tensors)
    except ValueError as e:
        raise ConfigError(f"{reader.path}: {e}") from None
    return base, {mod + ".weight": ab for mod, ab in pairs.items()}


# -- exports ---------------------------------------------------------------------------------------
@torch.no_grad()
def export_hf(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    model_cfg: ModelConfig | None = None,
    dtype: str = "bf16",
    max_shard_bytes: int = 2_000_000_000,
    merge_lora: bool = False,
    lora: LoraSection | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    model_type: str | None = None,
    hf_config_overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write one of our DCP checkpoints as an HF model folder `AutoModelForCausalLM.from_pretrained` reads.

    Offline, one process, no process group. `model_cfg` defaults to the checkpoint's model_config.json.
    Output shards hold at most `max_shard_bytes` (one bigger tensor gets a shard of its own); tensors are
    read from the checkpoint at most READ_BATCH_BYTES at a time, so peak memory is about max_shard_bytes
    (the shard being assembled, in `dtype`) + 256 MB (or the largest tensor, in the checkpoint's dtype).

    LoRA (`X.lora_A.weight`/`X.lora_B.weight` keys): with `merge_lora`, `X.weight += B @ A * alpha/rank`
    (alpha and rank from `lora` or the checkpoint's lora_config.json) and the adapters are dropped;
    without it they are an error (use merge_lora, or export_peft_adapter for the adapters alone).
    `hf_config_overrides` patches config.json (e.g. the base model's `max_position_embeddings`, since
    ours is the training sequence length). Returns {"files", "weight_map", "total_size", "config"}.
    """
    ck = Path(checkpoint_dir)
    out_dtype = _out_dtype(dtype)
    reader = CheckpointReader(ck)
    meta = CheckpointMeta.load(ck)
    cfg = model_cfg or meta.require_model(ck)
    base, pairs = _lora_pairs(reader)
    if pairs and not merge_lora:
        raise ConfigError(f"{ck} holds LoRA adapters ({next(iter(pairs)).removesuffix('.weight')}.lora_A, ...): "
                          "an HF export needs --merge-lora (fold them into the base weights) or --adapter-only "
                          "(a peft adapter)")
    scaling = 0.0
    if pairs:
        lo = lora or meta.require_lora(ck)
        scaling = lo.alpha / lo.rank
    expected = expected_shapes(cfg)
    try:  # our own checkpoints never duplicate the tied head: tied=False keeps a stray one an error
        validate({n: reader.tensors[n].shape for n in base}, expected, tied=False)
    except ValueError as e:
        raise ConfigError(f"{ck}: {e}") from None
    _check_lora(pairs, reader, expected)

    order = sorted(expected, key=natural_key)
    shards = plan_shards({n: math.prod(expected[n]) * out_dtype.itemsize for n in order}, max_shard_bytes)
    hf_cfg = config_to_hf(cfg, model_type)
    hf_cfg["torch_dtype"] = hf_cfg["dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    hf_cfg.update(hf_config_overrides or {})
    info = write_hf_folder(out_dir, [iter_hf_tensors(reader, s, pairs, scaling, out_dtype) for s in shards],
                           hf_cfg, tokenizer_dir)
    return {**info, "config": hf_cfg}


@torch.no_grad()
def export_peft_adapter(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    lora: LoraSection | None = None,
    *,
    base_model_name_or_path: str | None = None,
    dtype: str = "fp32",
) -> dict[str, Any]:
    """The LoRA adapters of a checkpoint as a peft folder (`adapter_model.safetensors` + `adapter_config.json`),
    named and configured by shardlm.lora's `to_peft_state_dict` / `peft_adapter_config`.

    `lora` defaults to the checkpoint's lora_config.json; its targets default to the adapted module
    names found in the checkpoint. Adapters are small: they are read in one go. Returns the adapter config.
    """
    ck, out = Path(checkpoint_dir), Path(out_dir)
    out_dtype = _out_dtype(dtype)
    reader = CheckpointReader(ck)
    _, pairs = _lora_pairs(reader)
    if not pairs:
        raise ConfigError(f"{ck} holds no LoRA adapters (no *.lora_A / *.lora_B tensors)")
    lo = lora or CheckpointMeta.load(ck).require_lora(ck)
    for ab in pairs.values():
        r = reader.tensors[ab["A"]].shape[0]
        if r != lo.rank:
            raise ConfigError(f"{ck}: {ab['A']!r} has rank {r} but the LoRA config says rank {lo.rank}")
    names = sorted((n for ab in pairs.values() for n in ab.values()), key=natural_key)
    try:
        sd = to_peft_state_dict(reader.read(names))
    except ValueError as e:
        raise ConfigError(f"{ck}: {e}") from None
    sd = {k: v.to(out_dtype).contiguous() for k, v in sd.items()}
    targets = lo.targets or sorted({w.removesuffix(".weight").rsplit(".", 1)[-1] for w in pairs})
    config = peft_adapter_config(lo.rank, lo.alpha, lo.dropout, targets,
                                 base_model_name_or_path=base_model_name_or_path or "")
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def export_checkpoint(checkpoint_dir: str | os.PathLike, out: str | os.PathLike, *, merge_lora: bool = False,
                      adapter_only: bool = False, dtype: str = "bf16",
                      tokenizer_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """`shardlm convert dcp-to-hf`: a checkpoint folder exported on its own, from its sidecar files.

    adapter_only: a peft adapter (its base named from the checkpoint's HF source). Otherwise an HF
    folder: refused for an adapters-only checkpoint (it has no base weights), with the base model's
    `max_position_embeddings` (ours is the training sequence length) and the tokenizer files of
    `tokenizer_dir` or of the tokenizer the run trained with. Returns {"kind": "peft"|"hf", ...}.
    """
    ck = Path(checkpoint_dir)
    if not (ck / METADATA).is_file():  # a command-line argument that names no checkpoint
        raise ConfigError(f"{ck} is not a complete shardlm checkpoint (no {METADATA}); pass a step-N directory")
    meta = CheckpointMeta.load(ck)
    if adapter_only:
        base = str(meta.hf_dir) if meta.hf_dir is not None else None
        return {"kind": "peft", "config": export_peft_adapter(ck, out, dtype="fp32", base_model_name_or_path=base)}
    if meta.lora is not None and meta.lora.adapters_only:
        raise ConfigError(f"{ck} holds LoRA adapters only (lora.adapters_only): export them with --adapter-only "
                          "and load them on the base model with peft")
    overrides = {}
    base_config = meta.hf_dir / "config.json" if meta.hf_dir is not None else None
    if base_config is not None and base_config.is_file():  # keep the base's context length, not our seq_len
        try:
            base_cfg = json.loads(base_config.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{base_config}: unreadable ({type(e).__name__}: {e})") from None
        if "max_position_embeddings" in base_cfg:
            overrides["max_position_embeddings"] = base_cfg["max_position_embeddings"]
    tok = tokenizer_dir_of(str(tokenizer_dir)) if tokenizer_dir is not None else meta.tokenizer_dir
    info = export_hf(ck, out, dtype=dtype, merge_lora=merge_lora, tokenizer_dir=tok,
                     hf_config_overrides=overrides or None)
    return {"kind": "hf", **info}
