"""What a config implies, computed from it and from the files it names (DESIGN.md: `resolve.py`).

`config.py` is the schema: fields, their docs and checks, importing nothing of shardlm above `errors`. What
needs more than the config's own values (a checkpoint's sidecar, a token store's manifest) is resolved here,
once, by the caller that owns the run, and handed down: the data and checkpoint layers take the result, not
the config: `resolve(cfg)` gives them all at once (`Resolved`), and the functions below are the one
definition of each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from shardlm.checkpoint.meta import CheckpointMeta
from shardlm.config import Config
from shardlm.data.sources import parse_sources
from shardlm.data.store.format import MANIFEST, is_store, store_path
from shardlm.distributed.env import device_type
from shardlm.errors import CheckpointError
from shardlm.quant.fp8 import fp8_all_gather


def tokenizer_spec(cfg: Config) -> str:
    """data.tokenizer with `auto` resolved: the HF model's own tokenizer when there is one (model.init_from's
    folder, or the one a dcp: checkpoint's HF source had), else the one a token store in data.path was
    prepared with, else bytes."""
    if cfg.data.tokenizer != "auto":
        return cfg.data.tokenizer
    d = cfg.model.hf_dir
    if cfg.model.dcp_dir is not None:  # the tokenizer its HF source had, when it recorded one
        try:
            d = CheckpointMeta.load(cfg.model.dcp_dir).tokenizer_dir
        except CheckpointError:
            d = None
    if d is not None and (d / "tokenizer.json").is_file():
        return str(d)
    return _store_tokenizer(cfg) or "bytes"


def _store_tokenizer(cfg: Config) -> str | None:
    """The tokenizer a token store in data.path (or the first source) was prepared with, if it is here."""
    path = parse_sources(cfg.data)[0].path
    if not is_store(path):
        return None
    try:
        spec = json.loads((store_path(path) / MANIFEST).read_text())["tokenizer"]["spec"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return spec if spec == "bytes" or Path(spec).exists() else None


def base_dtype(cfg: Config, device_type: str = "cuda") -> str:
    """lora.base_dtype resolved: bf16 | fp32 | nf4 (auto = the training precision on `device_type`)."""
    if cfg.lora.base_dtype != "auto":
        return cfg.lora.base_dtype
    return "fp32" if cfg.train.precision(device_type) == "fp32" else "bf16"


def frozen_dtype(cfg: Config, device_type: str = "cuda") -> torch.dtype:
    """Storage dtype of the frozen base parameters that are not NF4 (norms, embeddings, other linears)."""
    b = base_dtype(cfg, device_type)
    if b == "nf4":  # the rest of a QLoRA base: the training precision's
        b = "fp32" if cfg.train.precision(device_type) == "fp32" else "bf16"
    return torch.float32 if b == "fp32" else torch.bfloat16


def uses_fp8_all_gather(cfg: Config, device: torch.device) -> bool:
    """Whether FSDP all-gathers float8 weights (then the optimizer step is followed by a scale update)."""
    return cfg.train.mixed_precision == "fp8" and fp8_all_gather(cfg.train.fp8_recipe, device)


def checkpoint_dir(cfg: Config) -> Path:
    """checkpoint.dir, or <train.output_dir>/checkpoints."""
    c = cfg.checkpoint
    return Path(c.dir) if c.dir else Path(cfg.train.output_dir) / "checkpoints"


@dataclass(frozen=True)
class Resolved:
    """What a config means on this machine, resolved once at the start of a run and handed down."""

    device_type: str  # cuda | cpu (train.device with auto resolved)
    precision: str  # bf16 | fp32 | fp8 (train.mixed_precision with auto resolved)
    base_dtype: str  # bf16 | fp32 | nf4: LoRA's frozen base (lora.base_dtype with auto resolved)
    frozen_dtype: torch.dtype  # the frozen parameters that are not NF4
    fp8_all_gather: bool  # FSDP all-gathers float8 weights (scales precomputed after each step)
    tokenizer: str  # data.tokenizer with auto resolved: "bytes" or a path
    init_source: str  # random | hf | dcp (model.init_from)
    checkpoint_dir: Path

    @property
    def compute_dtype(self) -> str:
        """The matmul dtype FSDP's mixed precision casts to: bf16 under fp8 (torchao's linears take bf16)."""
        return "bf16" if self.precision == "fp8" else self.precision


def resolve(cfg: Config) -> Resolved:
    """Every derived setting of `cfg` (a CUDA request without a GPU is a ConfigError here)."""
    dev = device_type(cfg.train.device)
    m = cfg.model
    return Resolved(dev, cfg.train.precision(dev), base_dtype(cfg, dev), frozen_dtype(cfg, dev),
                    uses_fp8_all_gather(cfg, torch.device(dev)), tokenizer_spec(cfg),
                    "hf" if m.hf_dir is not None else "dcp" if m.dcp_dir is not None else "random",
                    checkpoint_dir(cfg))
