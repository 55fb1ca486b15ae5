"""Data: sources -> tokenizer -> cached token file -> packed windows -> per-dp-rank micro-batches."""

from shardlm.data.loader import PackedLoader, build_loader
from shardlm.data.sources import resolve_files
from shardlm.data.tokenizer import load_tokenizer

__all__ = ["PackedLoader", "build_loader", "resolve_files", "load_tokenizer"]
