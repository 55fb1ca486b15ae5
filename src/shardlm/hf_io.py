"""Hugging Face checkpoints in and out: sharded loading into FSDP2, offline DCP <-> safetensors conversion.

* `read_hf_config(dir)`: `config.json` -> our `ModelConfig`.
* `load_hf_weights(model, dir)`: fill an already-sharded model (FSDP2 DTensor parameters, or a plain
  module) from HF safetensors. Each rank reads only the rows it holds, straight from the files with
  `safe_open(...).get_slice(name)[rows]` (memory-mapped: only those bytes are touched); no rank ever
  holds a full tensor, there is no broadcast and no collective at all.
* `export_hf(checkpoint_dir, out_dir)`: one of our DCP checkpoints (`model.*` keys) -> HF safetensors
  shards + `model.safetensors.index.json` + `config.json`, in one process without a process group,
  reading a few tensors at a time (optionally merging LoRA adapters into the base weights).
* `export_peft_adapter(checkpoint_dir, out_dir)`: just the LoRA adapters, in peft's layout.
* `import_hf_to_dcp(dir, checkpoint_dir)`: HF safetensors -> a model-only DCP checkpoint, one tensor at
  a time.

The files beside DCP's own in one of our checkpoint folders (model_config.json, lora_config.json) are
read through `shardlm.checkpoint.meta.CheckpointMeta`.

Why not DCP's `HuggingFaceStorageReader` for `load_hf_weights`: it exists in every torch we support,
but older releases' `read_data` deserialise each whole safetensors file on every rank (later ones
slice), it globs every `*.safetensors` in the folder rather than following the index, and it adds a
plan all-gather. Slicing the files directly is the same reads with the memory bound guaranteed on
every torch version, and no collective.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from safetensors import safe_open
from torch import nn

from shardlm.checkpoint.meta import CheckpointMeta
from shardlm.config import LoraSection
from shardlm.errors import ConfigError
from shardlm.lora import is_lora_param, peft_adapter_config, to_peft_state_dict
from shardlm.models.hf import (
    config_from_hf,
    config_to_hf,
    expected_shapes,
    our_key_to_hf,
)
from shardlm.models.llama import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
OUT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_TIED_HEAD = "lm_head.weight"
_EMBED = "model.embed_tokens.weight"
# Wrappers that may sit between the root and a parameter (torch.compile, activation checkpointing).
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_LORA_RE = re.compile(r"^(?P<base>.+)\.lora_(?P<ab>[AB])\.weight$")  # shardlm.lora's names
_SINGLE_PROCESS_WARNING = r".*torch\.distributed is disabled.*"  # dcp's no_dist notice, once per call
_READ_BATCH_BYTES = 256 * 2**20  # export: checkpoint bytes read per dcp.load call (one tensor if larger)


# -- config ----------------------------------------------------------------------------------------
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


# -- HF safetensors folders ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _HFTensor:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' spelling: F32, BF16, ...


def scan_hf_weights(hf_dir: str | os.PathLike) -> dict[str, _HFTensor]:
    """HF tensor name -> (file, shape, dtype), from the index (or the single file) and the files' headers.

    Reads headers only (a few KB per file). ConfigError when the folder, the index or a file is broken.
    """
    d = Path(hf_dir)
    index, single = d / INDEX_FILE, d / SINGLE_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index}: unreadable index ({type(e).__name__}: {e})") from None
        files = sorted(set(weight_map.values()))
    elif single.is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        found = sorted(p.name for p in d.glob("*.safetensors")) if d.is_dir() else []
        hint = f" (found {', '.join(found[:3])} without an index)" if found else ""
        raise ConfigError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE}{hint}; pass a folder saved by "
                          "save_pretrained with safetensors")
    out: dict[str, _HFTensor] = {}
    for name in files:
        path = d / name
        if not path.is_file():
            raise ConfigError(f"{index}: lists {name} but {path} does not exist (incomplete download?)")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    if key in out:
                        raise ConfigError(f"{d}: tensor {key!r} is stored twice ({out[key].file.name}, {name})")
                    out[key] = _HFTensor(path, tuple(sl.get_shape()), sl.get_dtype())
        except ConfigError:
            raise
        except Exception as e:  # a truncated or foreign file
            raise ConfigError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in out or out[key].file.name != name:
                raise ConfigError(f"{index}: says tensor {key!r} is in {name}, but that file does not hold it")
    return out


def _check_names_shapes(stored: Mapping[str, _HFTensor], want: Mapping[str, tuple[int, ...]], tied: bool,
                        where: Path) -> dict[str, str]:
    """want: HF name -> shape our model needs. Returns HF name wanted -> HF name to read it from.

    Tied models: `lm_head.weight` in the files is ignored (it duplicates the embedding) and is used for
    the embedding only when the embedding itself is absent.
    """
    source = {k: k for k in want}
    if tied and _EMBED in want and _EMBED not in stored and _TIED_HEAD in stored:
        source[_EMBED] = _TIED_HEAD
    missing = [k for k, s in source.items() if s not in stored]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ConfigError(f"{where}: missing tensor(s) {', '.join(missing[:5])}{more}: the weights do not match "
                          "config.json")
    used = set(source.values())
    for key in stored:
        if key in used or key.endswith("rotary_emb.inv_freq") or (tied and key == _TIED_HEAD):
            continue
        raise ConfigError(f"{where}: unexpected tensor {key!r}: our model for this config.json has no such "
                          "parameter")
    for key, src in source.items():
        if stored[src].shape != tuple(want[key]):
            raise ConfigError(f"{where}: tensor {src!r} has shape {stored[src].shape}, expected "
                              f"{tuple(want[key])} (from config.json)")
        if stored[src].dtype not in _ST_DTYPES:
            raise ConfigError(f"{where}: tensor {src!r} has dtype {stored[src].dtype}; expected a float type")
    return source


# -- loading into a (sharded) model ----------------------------------------------------------------
def _clean_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _local_region(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, its shape, its offset in the global tensor) for a DTensor or a plain tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return p.data, tuple(p.shape), (0,) * p.ndim
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = p.to_local()
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard of shape {tuple(local.shape)} where the placements say {tuple(shape)}")
    return local, tuple(shape), tuple(offset)


def _check_config(model_cfg: ModelConfig, hf_dir: Path) -> None:
    """The model was built for this folder's config.json (max_seq_len aside): shapes alone would not catch
    a different RoPE base or scaling, norm epsilon or tying."""
    if not (hf_dir / "config.json").is_file():
        return
    theirs, _ = read_hf_config(hf_dir, max_seq_len=model_cfg.max_seq_len)
    diff = [f"{f.name} {getattr(model_cfg, f.name)!r} vs {getattr(theirs, f.name)!r}"
            for f in dataclasses.fields(ModelConfig) if getattr(model_cfg, f.name) != getattr(theirs, f.name)]
    if diff:
        raise ConfigError(f"{hf_dir}: the model's config differs from config.json ({'; '.join(diff)}); build it "
                          "from read_hf_config, or pass check_config=False if the change is deliberate")


@torch.no_grad()
def load_hf_weights(model: nn.Module, hf_dir: str | os.PathLike, *, check_config: bool = True) -> list[str]:
    """Copy HF safetensors weights into `model`'s parameters, each rank reading only its own slices.

    `model` is our `Transformer` after `fully_shard` + `to_empty` (DTensor parameters), or a plain one.
    Names and shapes are checked against the files' headers first (ConfigError naming the tensor), then
    each parameter's local region `[offset, offset + local_shape)` is read with `get_slice`; the dtype
    is converted on the copy. No collective runs, so ranks need not call it in lockstep. RoPE buffers
    are recomputed afterwards. With `check_config`, `model.cfg` must equal what config.json describes
    (max_seq_len excepted): same shapes with another RoPE base would otherwise load silently.

    Returns the names of parameters that HF checkpoints do not hold and that were left untouched
    (LoRA adapters): initialise those yourself (e.g. `init_weights()` before this call).
    """
    d = Path(hf_dir)
    cfg = getattr(model, "cfg", None)
    tied = bool(getattr(cfg, "tie_embeddings", False))
    params: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for name, p in model.named_parameters():
        if is_lora_param(name):
            skipped.append(name)
            continue
        if p.is_meta:
            raise RuntimeError(f"load_hf_weights: parameter {name!r} is on the meta device; call "
                               "model.to_empty(device=...) first")
        params[our_key_to_hf(_clean_name(name))] = p
    if check_config and isinstance(cfg, ModelConfig):
        _check_config(cfg, d)
    stored = scan_hf_weights(d)
    want = {k: tuple(p.shape) for k, p in params.items()}
    source = _check_names_shapes(stored, want, tied, d)
    by_file: dict[Path, list[str]] = {}
    for key in params:
        by_file.setdefault(stored[source[key]].file, []).append(key)
    for path, keys in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for key in keys:
                local, shape, offset = _local_region(params[key])
                if local.numel() == 0:
                    continue  # more ranks than rows: this rank holds none of it
                region = tuple(slice(o, o + n) for o, n in zip(offset, shape))
                local.copy_(f.get_slice(source[key])[region])
    rope = getattr(model, "rope", None)
    if rope is not None:
        rope.reset_parameters()
    return skipped


# -- our DCP checkpoints ---------------------------------------------------------------------------
def _dcp():
    import torch.distributed.checkpoint as dcp

    return dcp


def _checkpoint_tensors(checkpoint_dir: Path) -> dict[str, Any]:
    """Our tensor name (without `model.`) -> DCP TensorStorageMetadata, for the `model.*` entries."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (checkpoint_dir / ".metadata").is_file():
        raise ConfigError(f"{checkpoint_dir} is not a complete DCP checkpoint (no .metadata); pass a step-N "
                          "folder that finished saving")
    try:
        md = _dcp().FileSystemReader(str(checkpoint_dir)).read_metadata()
    except Exception as e:
        raise ConfigError(f"{checkpoint_dir}: unreadable checkpoint metadata ({type(e).__name__}: {e})") from None
    out = {}
    for key, m in md.state_dict_metadata.items():
        if not key.startswith("model."):
            continue
        if not isinstance(m, TensorStorageMetadata):
            raise ConfigError(f"{checkpoint_dir}: {key!r} is not a tensor")
        out[key[len("model."):]] = m
    if not out:
        raise ConfigError(f"{checkpoint_dir}: no model.* tensors in this checkpoint")
    return out


def _make_reader(checkpoint_dir: Path):
    """A FileSystemReader that parses `.metadata` once, however many `dcp.load` calls use it."""
    base = _dcp().FileSystemReader

    class _CachedReader(base):  # type: ignore[misc, valid-type]
        _md = None

        def read_metadata(self, *args, **kwargs):
            if self._md is None:
                self._md = super().read_metadata(*args, **kwargs)
            return self._md

    return _CachedReader(str(checkpoint_dir))


def _read_tensors(reader, metas: Mapping[str, Any], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Full tensors `names` (ours, no prefix) from the checkpoint, in the dtype they were saved in."""
    from shardlm.checkpoint import SafeLoadPlanner

    out = {n: torch.empty(tuple(metas[n].size), dtype=metas[n].properties.dtype) for n in names}
    if out:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
            _dcp().load({"model": out}, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return out


def _batches(names: list[str], metas: Mapping[str, Any], limit: int) -> Iterable[list[str]]:
    batch, size = [], 0
    for n in names:
        m = metas[n]
        b = math.prod(m.size) * m.properties.dtype.itemsize
        if batch and size + b > limit:
            yield batch
            batch, size = [], 0
        batch.append(n)
        size += b
    if batch:
        yield batch


def _natural(key: str) -> list:
    """Sort key: embed, layers in numeric order, norm, head (the order HF writes them in)."""
    rank = 0 if "embed_tokens" in key else 2 if key.startswith("norm.") else 3 if key.startswith("lm_head") else 1
    return [rank] + [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


# -- LoRA ------------------------------------------------------------------------------------------
def _split_lora(names: Iterable[str]) -> tuple[list[str], dict[str, dict[str, str]]]:
    """(base names, {module: {"A": name, "B": name}}) for shardlm.lora's `X.lora_A.weight`/`X.lora_B.weight`."""
    base, lora = [], {}
    for n in names:
        m = _LORA_RE.match(n)
        if m:
            lora.setdefault(m["base"], {})[m["ab"]] = n
        else:
            base.append(n)
    for mod, ab in lora.items():
        if set(ab) != {"A", "B"}:
            raise ConfigError(f"LoRA module {mod!r} has lora_{next(iter(ab))} but not its pair")
    return base, lora


# -- export ----------------------------------------------------------------------------------------
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
    read from the checkpoint at most ~256 MB at a time, so peak memory is about max_shard_bytes (the
    shard being assembled, in `dtype`) + 256 MB (or the largest tensor, in the checkpoint's dtype).

    LoRA (`X.lora_A.weight`/`X.lora_B.weight` keys, as shardlm.lora names them): with `merge_lora`, `X.weight += B @ A * alpha/rank`
    (alpha and rank from `lora` or the checkpoint's lora_config.json) and the adapters are dropped; without it they
    are an error (use merge_lora, or export_peft_adapter for the adapters alone).
    Existing `model*.safetensors` and the index in `out_dir` are replaced.
    `hf_config_overrides` patches config.json (e.g. the base model's `max_position_embeddings`, since
    ours is the training sequence length). Returns {"files", "weight_map", "total_size", "config"}.
    """
    ck, out = Path(checkpoint_dir), Path(out_dir)
    if dtype not in OUT_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {', '.join(OUT_DTYPES)}")
    out_dtype = OUT_DTYPES[dtype]
    metas = _checkpoint_tensors(ck)
    meta = CheckpointMeta.load(ck)
    cfg = model_cfg or meta.require_model(ck)
    base, pairs = _split_lora(metas)
    if pairs and not merge_lora:
        raise ConfigError(f"{ck} holds LoRA adapters ({next(iter(pairs))}.lora_A, ...): an HF export needs "
                          "--merge-lora (fold them into the base weights) or --adapter-only (a peft adapter)")
    scaling = 0.0
    if pairs:
        lo = lora or meta.require_lora(ck)
        scaling = lo.alpha / lo.rank
    names = [_clean_name(n) for n in base]
    expected = expected_shapes(cfg)
    missing = [n for n in expected if n not in names]
    if missing:
        raise ConfigError(f"{ck}: missing tensor(s) {', '.join(missing[:5])} for this model config")
    for n, orig in zip(names, base):
        if n not in expected:
            raise ConfigError(f"{ck}: unexpected tensor {orig!r}: the model config has no such parameter")
        if tuple(metas[orig].size) != expected[n]:
            raise ConfigError(f"{ck}: tensor {orig!r} has shape {tuple(metas[orig].size)}, expected {expected[n]}")
    src_of = dict(zip(names, base))
    lora_of = {_clean_name(mod) + ".weight": ab for mod, ab in pairs.items()}
    for w, ab in lora_of.items():
        if w not in expected:
            raise ConfigError(f"{ck}: LoRA adapter on {w!r}, which the model does not have")
        a, b = tuple(metas[ab["A"]].size), tuple(metas[ab["B"]].size)
        o, i = expected[w]
        if len(a) != 2 or len(b) != 2 or a[1] != i or b[0] != o or a[0] != b[1]:
            raise ConfigError(f"{ck}: LoRA shapes A {a}, B {b} do not fit {w!r} of shape {(o, i)}")

    # Plan the output shards from the metadata alone.
    order = sorted(expected, key=_natural)
    nbytes = {n: math.prod(expected[n]) * out_dtype.itemsize for n in order}
    shards: list[list[str]] = []
    for n in order:
        if shards and sum(nbytes[k] for k in shards[-1]) + nbytes[n] <= max_shard_bytes:
            shards[-1].append(n)
        else:
            shards.append([n])
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("model*.safetensors")) + [out / INDEX_FILE]:
        old.unlink(missing_ok=True)  # a previous export's shards would mix in
    reader = _make_reader(ck)
    weight_map: dict[str, str] = {}
    files = []
    for i, shard in enumerate(shards, start=1):
        fname = _shard_name(i, len(shards))
        tensors: dict[str, torch.Tensor] = {}
        needed = []  # checkpoint names to read for this shard
        for n in shard:
            needed.append(src_of[n])
            if n in lora_of:
                needed += [lora_of[n]["A"], lora_of[n]["B"]]
        loaded: dict[str, torch.Tensor] = {}
        for batch in _batches(needed, metas, _READ_BATCH_BYTES):
            loaded.update(_read_tensors(reader, metas, batch))
            for n in shard:  # convert whatever is complete, freeing the checkpoint-dtype copies
                if n in tensors or src_of[n] not in loaded:
                    continue
                ab = lora_of.get(n)
                if ab and not (ab["A"] in loaded and ab["B"] in loaded):
                    continue
                w = loaded.pop(src_of[n])
                if ab:
                    a, b = loaded.pop(ab["A"]).float(), loaded.pop(ab["B"]).float()
                    w = (w.float() + (b @ a) * scaling)
                tensors[our_key_to_hf(n)] = w.to(out_dtype).contiguous()
        if len(tensors) != len(shard):  # cannot happen: every batch's complete tensors were converted
            raise RuntimeError(f"export: shard {fname} assembled {len(tensors)} of {len(shard)} tensors")
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        files.append(fname)
        del tensors, loaded
    total = sum(nbytes.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    hf_cfg = config_to_hf(cfg, model_type)
    hf_cfg["torch_dtype"] = hf_cfg["dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    hf_cfg.update(hf_config_overrides or {})
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    _copy_tokenizer(tokenizer_dir, out)
    return {"files": files, "weight_map": weight_map, "total_size": total, "config": hf_cfg}


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

    `lora` defaults to the checkpoint's lora_config.json; target_modules default to the adapted module names found in the checkpoint. Adapters are small: they
    are read in one go. Returns the adapter config written.
    """
    ck, out = Path(checkpoint_dir), Path(out_dir)
    if dtype not in OUT_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {', '.join(OUT_DTYPES)}")
    metas = _checkpoint_tensors(ck)
    _, pairs = _split_lora(metas)
    if not pairs:
        raise ConfigError(f"{ck} holds no LoRA adapters (no *.lora_A / *.lora_B tensors)")
    lo = lora or CheckpointMeta.load(ck).require_lora(ck)
    names = sorted((n for ab in pairs.values() for n in ab.values()), key=_natural)
    for mod, ab in pairs.items():
        r = tuple(metas[ab["A"]].size)[0]
        if r != lo.rank:
            raise ConfigError(f"{ck}: {ab['A']!r} has rank {r} but the LoRA config says rank {lo.rank}")
    loaded = _read_tensors(_make_reader(ck), metas, names)
    try:
        sd = to_peft_state_dict({_clean_name(n): t for n, t in loaded.items()})
    except ValueError as e:
        raise ConfigError(f"{ck}: {e}") from None
    sd = {k: v.to(OUT_DTYPES[dtype]).contiguous() for k, v in sd.items()}
    targets = lo.targets or sorted({mod.rsplit(".", 1)[-1] for mod in pairs})
    config = peft_adapter_config(lo.rank, lo.alpha, lo.dropout, targets,
                                 base_model_name_or_path=base_model_name_or_path or "")
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


# -- import ----------------------------------------------------------------------------------------
def _lazy_hf_planner(sources: Mapping[str, tuple[Path, str]], dtype_of: Mapping[str, torch.dtype]):
    """A DCP save planner whose state dict holds meta tensors; each tensor's data is read from its HF file
    (and converted) only when the writer asks for it, then dropped after it is written."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class _LazyHFPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            fqn = write_item.index.fqn
            path, hf_name = sources[fqn]
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(hf_name).to(dtype_of[fqn], copy=True).contiguous()

    return _LazyHFPlanner()


@torch.no_grad()
def import_hf_to_dcp(
    hf_dir: str | os.PathLike,
    out_checkpoint_dir: str | os.PathLike,
    *,
    dtype: str | None = "fp32",
    max_seq_len: int | None = None,
) -> ModelConfig:
    """Convert an HF model folder to a model-only DCP checkpoint (`model.*` keys) our trainer can load.

    Offline, one process, no process group (`dcp.save(no_dist=True)`). The state dict DCP plans with
    holds meta tensors; a custom planner reads each tensor from its safetensors file when the writer
    reaches it, so at most about one tensor (plus its `dtype` copy) is in memory at a time — peak
    memory is ~2x the largest tensor (the embedding), whatever the model size. `dtype` None keeps the
    files' dtypes; the default fp32 matches our training parameters. Also writes model_config.json.
    The result is one `__0_0.distcp` file: any number of ranks can load it (DCP reshards on load).
    Returns the ModelConfig.
    """
    src = Path(hf_dir)
    cfg, _ = read_hf_config(src, max_seq_len=max_seq_len)
    stored = scan_hf_weights(src)
    want = {our_key_to_hf(k): v for k, v in expected_shapes(cfg).items()}
    source = _check_names_shapes(stored, want, cfg.tie_embeddings, src)
    if dtype is not None and dtype not in OUT_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {', '.join(OUT_DTYPES)} or None")
    sources, dtype_of, meta_sd = {}, {}, {}
    for ours, shape in expected_shapes(cfg).items():
        hf_name = source[our_key_to_hf(ours)]
        t = stored[hf_name]
        dt = OUT_DTYPES[dtype] if dtype is not None else _ST_DTYPES[t.dtype]
        fqn = f"model.{ours}"
        sources[fqn], dtype_of[fqn] = (t.file, hf_name), dt
        meta_sd[ours] = torch.empty(shape, dtype=dt, device="meta")
    out = Path(out_checkpoint_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not an empty folder; pass a new checkpoint folder")
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        _dcp().save({"model": meta_sd}, checkpoint_id=str(tmp), planner=_lazy_hf_planner(sources, dtype_of),
                    no_dist=True)
    CheckpointMeta(model=cfg).save(tmp)
    if out.exists():
        out.rmdir()  # an empty folder (a non-empty one is refused by rmdir)
    tmp.rename(out)
    return cfg
