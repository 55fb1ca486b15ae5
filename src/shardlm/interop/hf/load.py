"""Sharded loading of HF safetensors into an FSDP2 model: each rank reads only its own slices.

`load_hf_weights(model, dir)` fills an already-sharded model (DTensor parameters, or a plain module)
straight from the files with `safe_open(...).get_slice(name)[region]` (memory-mapped: only those bytes
are touched); no rank ever holds a full tensor, there is no broadcast and no collective at all, except
for NF4 parameters (lora.base_dtype=nf4): each rank quantises its own rows, after one small all-gather
of block scales per weight (`shardlm.quant.nf4.quantize_shard`).

Why not DCP's `HuggingFaceStorageReader`: it exists in every torch we support, but older releases'
`read_data` deserialise each whole safetensors file on every rank (later ones slice), it globs every
`*.safetensors` in the folder rather than following the index, and it adds a plan all-gather. Slicing
the files directly is the same reads with the memory bound guaranteed on every torch version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shardlm.errors import ConfigError
from shardlm.interop.hf.config import default_model_type, read_hf_config
from shardlm.interop.hf.names import Source, hf_shapes, hf_sources, is_fused_layout, our_key_to_hf, validate
from shardlm.lora import is_lora_param
from shardlm.models.llama import ModelConfig
from shardlm.parallel.fsdp import shard_region
from shardlm.quant.nf4 import NF4_DTYPE, is_nf4, model_shape, nf4_params, quantize_into

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class HFTensor:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' spelling: F32, BF16, ...


def scan_hf_weights(hf_dir: str | os.PathLike) -> dict[str, HFTensor]:
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
    out: dict[str, HFTensor] = {}
    for name in files:
        path = d / name
        if not path.is_file():
            raise ConfigError(f"{index}: lists {name} but {path} does not exist (incomplete download?)")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    sl = f.get_slice(key)
                    if key in out:
                        raise ConfigError(f"{d}: tensor {key!r} is stored twice ({out[key].file.name}, {name})")
                    out[key] = HFTensor(path, tuple(sl.get_shape()), sl.get_dtype())
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 (a truncated or foreign file: any parser error)
            raise ConfigError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in out or out[key].file.name != name:
                raise ConfigError(f"{index}: says tensor {key!r} is in {name}, but that file does not hold it")
    return out


def check_hf_tensors(stored: Mapping[str, HFTensor], want: Mapping[str, tuple[int, ...]], tied: bool,
                     where: Path) -> dict[str, str]:
    """`names.validate` over an HF folder's tensors (HF names), plus: every tensor read is a float.

    Returns HF name wanted -> HF name to read it from; ConfigError naming the folder.
    """
    try:
        source = validate({k: t.shape for k, t in stored.items()}, want, tied, against="config.json")
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    for src in source.values():
        if stored[src].dtype not in ST_DTYPES:
            raise ConfigError(f"{where}: tensor {src!r} has dtype {stored[src].dtype}; expected a float type")
    return source


def hf_layout(cfg: ModelConfig, hf_dir: Path, stored: Mapping[str, HFTensor]) -> dict:
    """Our name -> `names.Source` for this folder: its config.json's model_type (else the one `cfg` implies),
    experts in the published per-expert layout or the fused one, whichever the files hold."""
    mt = default_model_type(cfg)
    path = hf_dir / "config.json"
    if path.is_file():
        with contextlib.suppress(OSError, ValueError, AttributeError):
            mt = json.loads(path.read_text()).get("model_type") or mt
    return hf_sources(cfg, mt, fused=is_fused_layout(stored))


def _check_config(model_cfg: ModelConfig, hf_dir: Path) -> None:
    """The model was built for this folder's config.json (max_seq_len aside): shapes alone would not catch
    a different RoPE base or scaling, norm epsilon or tying."""
    if not (hf_dir / "config.json").is_file():
        return
    theirs, _ = read_hf_config(hf_dir, max_seq_len=model_cfg.max_seq_len)
    # training coefficients are not the checkpoint's shape: model.router_*_loss_coef may override them
    theirs = dataclasses.replace(theirs, router_aux_loss_coef=model_cfg.router_aux_loss_coef,
                                 router_z_loss_coef=model_cfg.router_z_loss_coef)
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
    is converted on the copy. No collective runs, so ranks need not call it in lockstep (unless the model has
    NF4 parameters: then every rank of the shard group calls it). RoPE buffers
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
        params[name] = p
    if check_config and isinstance(cfg, ModelConfig):
        _check_config(cfg, d)
    stored = scan_hf_weights(d)
    sources = hf_layout(cfg, d, stored) if isinstance(cfg, ModelConfig) else {}
    sources = {n: sources.get(n) or Source((our_key_to_hf(n),)) for n in params}
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    shapes.update((n, model_shape(*owner)) for n, owner in nf4_params(model).items())  # stacked experts held flat
    source = check_hf_tensors(stored, hf_shapes(shapes, sources), tied, d)
    nf4 = {n for n, p in params.items() if is_nf4(p)}
    with contextlib.ExitStack() as stack:
        files: dict[Path, object] = {}

        def read(hf_name: str, region: tuple[slice, ...]) -> torch.Tensor:
            src = source[hf_name]
            path = stored[src].file
            if path not in files:
                files[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            return files[path].get_slice(src)[region]

        def copy(name: str, local: torch.Tensor, offset: tuple[int, ...]) -> torch.Tensor:
            region = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
            for hf_name, hf_region, row in sources[name].region(region):  # stacked experts: one piece per expert
                (local if row is None else local[row]).copy_(read(hf_name, hf_region))
            return local

        for name in sorted(params, key=lambda n: str(stored[source[sources[n].names[0]]].file)):
            if name in nf4:
                continue
            local, shape, offset = shard_region(params[name])
            if local.numel():  # else more ranks than rows: this rank holds none of it
                copy(name, local, offset)
        if nf4:  # QLoRA base: this rank's rows in bf16, quantised (one small all-gather per weight)
            def fill(name: str, p: torch.Tensor, shape: tuple[int, ...], row0: int) -> torch.Tensor:
                return copy(name, torch.empty(shape, dtype=NF4_DTYPE, device=p.device), (row0,) + (0,) * (len(shape) - 1))

            device = next(iter(params.values())).device
            quantize_into(model, fill, device)
    rope = getattr(model, "rope", None)
    if rope is not None:
        rope.reset_parameters()
    return skipped
