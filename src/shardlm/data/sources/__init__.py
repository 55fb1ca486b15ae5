"""Where text comes from: one reader per input format behind one interface (`base.Reader`) and one registry
(`registry.READERS`): .txt (`text`), .jsonl / .jsonl.gz / .jsonl.zst (`jsonl`), .parquet (`parquet`),
.arrow (`arrow`), `datasets` save_to_disk folders (`hf_datasets`), the built-in corpus builtin:stdlib
(`builtin`). Adding a format is one module and one registry entry.

data.path (or [[data.sources]]) is parsed once into a typed list (`parse_sources`); `resolve_sources` turns
one path into its files, `plan_units` cuts them into units of work, `read_texts` / `read_records` read a unit.
.parquet and .arrow need pyarrow, .jsonl.zst needs zstandard (the [data] extra), imported on first use.
"""

from shardlm.data.sources.base import BadRecords, Reader, Unit
from shardlm.data.sources.builtin import BUILTIN, builtin_files, is_stdlib, skipped_line, stdlib_dir
from shardlm.data.sources.registry import (READERS, SUFFIXES, SUPPORTED, iter_documents, plan_units, read_records,
                                           read_texts, reader_for, resolve_files, resolve_sources)
from shardlm.data.sources.spec import SourceEntry, parse_sources

__all__ = ["BUILTIN", "BadRecords", "READERS", "Reader", "SUFFIXES", "SUPPORTED", "SourceEntry", "Unit",
           "builtin_files", "is_stdlib", "iter_documents", "parse_sources", "plan_units", "read_records",
           "read_texts", "reader_for", "resolve_files", "resolve_sources", "skipped_line", "stdlib_dir"]
