"""What a config implies, computed from it and from the files it names (DESIGN.md: `resolve.py`).

`config.py` is the schema: fields, their docs and checks, importing nothing of shardlm above `errors`. What
needs more than the config's own values (a checkpoint's sidecar, a token store's manifest) is resolved here,
once, by the caller that owns the run, and handed down: the data and checkpoint layers take the result, not
the config. Today: the tokenizer reference; the other derived settings move here with the architecture issue.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardlm.checkpoint.meta import CheckpointMeta
from shardlm.config import Config
from shardlm.data.store import MANIFEST, is_store, store_path
from shardlm.errors import CheckpointError


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
    path = cfg.data.sources[0].path if cfg.data.sources else cfg.data.path
    if not is_store(path):
        return None
    try:
        spec = json.loads((store_path(path) / MANIFEST).read_text())["tokenizer"]["spec"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return spec if spec == "bytes" or Path(spec).exists() else None
