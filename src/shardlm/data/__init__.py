"""Data: sources (one reader per format) -> token store (format, prepare, cache; memmap) -> packed windows (+ document masks) -> one source
or a mixture -> per-dp-rank micro-batches in the global sample order.

`open_stores(cfg.data, tokenizer)` (before the process group starts) then `build_loader(cfg.data, tokenizer,
dp_rank, dp_size, micro_batch_size=, grad_accum=, seed=, stores=...)` builds the loader `data.format` names (text: PackedLoader or MixtureLoader;
sft: SFTLoader).

The names below are imported on first use: `shardlm prepare`'s worker processes import
`shardlm.data.store.prepare` without torch (seconds per worker at start-up).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "MixtureLoader": "loader", "PackedLoader": "loader", "build_loader": "loader", "open_stores": "loader",
    "IGNORE_INDEX": "order", "RowLoader": "order", "SampleOrder": "order",
    "SourceEntry": "sources", "builtin_files": "sources", "parse_sources": "sources", "resolve_files": "sources",
    "TokenStore": "store.format", "prepare": "store.prepare",
    "TokenizerRef": "tokenizer", "load_tokenizer": "tokenizer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
