"""Data: sources -> tokenizer -> cached token file -> packed windows -> per-dp-rank micro-batches.

`build_loader(cfg, tokenizer, dp_rank, dp_size, is_builder, barrier, log)` builds the loader
`data.format` names (text: PackedLoader; sft: SFTLoader), both over one `SampleOrder`.
"""

from shardlm.data.loader import PackedLoader, build_loader, build_packed_loader
from shardlm.data.order import IGNORE_INDEX, RowLoader, SampleOrder
from shardlm.data.sources import builtin_files, resolve_files
from shardlm.data.tokenizer import load_tokenizer

__all__ = ["IGNORE_INDEX", "PackedLoader", "RowLoader", "SampleOrder", "build_loader", "build_packed_loader",
           "builtin_files", "resolve_files", "load_tokenizer"]
