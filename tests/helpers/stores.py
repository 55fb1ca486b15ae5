"""Small token stores for tests that train on them: byte-tokenised text documents and prompt/completion
SFT records, each with a validation split (what `shardlm prepare --val-fraction` makes)."""

from __future__ import annotations

import json
from pathlib import Path

from shardlm.data.sources import resolve_sources
from shardlm.data.store.prepare import PrepareSpec, prepare, sft_spec
from shardlm.data.tokenizer import ByteTokenizer


def _quiet(_: str) -> None:
    pass


def text_store(docs: list[str], out: Path, val_fraction: float) -> Path:
    """A store of `docs` (one JSON line each, beside `out` as OUT.jsonl), split `val_fraction` for validation."""
    src = out.with_suffix(".jsonl")
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    prepare(PrepareSpec(resolve_sources(str(src)), "bytes", ByteTokenizer.fingerprint, "text",
                        val_fraction=val_fraction, seed=1), out, workers=1, log=_quiet)
    return out


def sft_store(records: list[dict], out: Path, val_fraction: float) -> Path:
    """An SFT store of prompt/completion `records` (beside `out` as OUT.jsonl)."""
    src = out.with_suffix(".jsonl")
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = sft_spec([src], ByteTokenizer(), None)
    spec.val_fraction, spec.seed = val_fraction, 1
    prepare(spec, out, workers=1, log=_quiet)
    return out
