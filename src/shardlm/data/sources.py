"""Where text comes from: the built-in corpus (the stdlib's .py files) and `data.path`, read by
`shardlm.data.readers` (.txt, .jsonl(.gz/.zst), .parquet, .arrow, `datasets` folders)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

from shardlm.data.readers import (BUILTIN, SUFFIXES, BadRecords, builtin_files, plan_units, read_texts,
                                  resolve_sources, stdlib_dir)

__all__ = ["BUILTIN", "SUFFIXES", "builtin_files", "iter_documents", "resolve_files", "skipped_line", "stdlib_dir"]


def resolve_files(spec: str) -> list[Path]:
    """The files `data.path` names, in order; a clear error when there are none (`readers.resolve_sources`)."""
    return resolve_sources(spec)


def iter_documents(files: list[Path], text_field: str, max_bad_fraction: float = 0.001) -> Iterator[str]:
    """Documents in order: a .txt (or built-in .py) file is one; a .jsonl line or a Parquet/Arrow row is one.

    Bad records (not UTF-8, not JSON, no string `text_field`) are skipped and summed up in one line at the
    end; a DataError at the end when more than `max_bad_fraction` of the records are bad. The stdlib's own
    files that are not UTF-8 are left out of that count: one note (`skipped_line`).
    """
    bad, skipped, root = BadRecords(), [], stdlib_dir()
    for unit in plan_units(files):
        got = BadRecords()
        yield from read_texts(unit, text_field, got)
        if got.bad and unit.path.endswith(".py") and Path(unit.path).is_relative_to(root):
            skipped.append((Path(unit.path), got.examples[0]))
        else:
            bad.merge(got)
    if skipped:
        print(skipped_line(skipped), file=sys.stderr, flush=True)
    bad.check(max_bad_fraction)
    if line := bad.line():
        print(f"shardlm: warning: {line}", file=sys.stderr, flush=True)


def skipped_line(skipped: list[tuple[Path, str]], shown: int = 4) -> str:
    """One line for the files that are not UTF-8: a note for the stdlib's own (a few of its test files
    are Latin-1 or broken on purpose), a warning for the user's files, with the first `shown` named."""
    n = len(skipped)
    files = f"{n} file that is" if n == 1 else f"{n} files that are"
    more = f", and {n - shown} more" if n > shown else ""
    root = stdlib_dir()
    if all(f.is_relative_to(root) for f, _ in skipped):
        names = ", ".join(str(f.relative_to(root)) for f, _ in skipped[:shown])
        return f"shardlm: stdlib corpus: skipped {files} not UTF-8 ({names}{more})"
    names = ", ".join(f"{f} ({why})" for f, why in skipped[:shown])
    return f"shardlm: warning: skipped {files} not valid UTF-8 in data.path: {names}{more}"
