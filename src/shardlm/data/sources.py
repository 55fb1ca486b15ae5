"""Where text comes from: the built-in corpus, .txt files, .jsonl records."""

from __future__ import annotations

import glob
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

from shardlm.errors import ConfigError, DataError

BUILTIN = "builtin:stdlib"
SUFFIXES = (".txt", ".jsonl")


def stdlib_dir() -> Path:
    """The running Python's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def builtin_files(max_depth: int | None = None) -> list[Path]:
    """The running Python's standard library sources (.py; installed packages left out): on every
    machine, no download. In walk order: a folder's files sorted by name, then each subfolder (sorted)
    in full. `max_depth`: 0 = the top-level modules only, 1 = also the files one folder down, None = all.
    This is the one stdlib-corpus walker (the built-in corpus, the debug HF assets, tests, benchmarks).
    """
    root = stdlib_dir()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        if max_depth is not None and len(Path(dirpath).relative_to(root).parts) >= max_depth:
            dirnames[:] = []
        else:
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return files


def resolve_files(spec: str) -> list[Path]:
    """The sorted list of files `data.path` names; a clear error when there are none."""
    if spec == BUILTIN:
        files = builtin_files()
    elif any(c in spec for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(spec, recursive=True) if f.endswith(SUFFIXES))
    elif Path(spec).is_dir():
        files = sorted(f for f in Path(spec).rglob("*") if f.suffix in SUFFIXES and f.is_file())
    elif Path(spec).is_file():
        if not spec.endswith(SUFFIXES):
            raise ConfigError(f"data.path {spec!r}: unsupported file type; use .txt or .jsonl")
        files = [Path(spec)]
    else:
        raise ConfigError(f"data.path {spec!r} does not exist; pass a .txt/.jsonl file, a directory, a glob or {BUILTIN}")
    if not files:
        raise ConfigError(f"data.path {spec!r} holds no .txt or .jsonl files")
    return files


def iter_documents(files: list[Path], text_field: str) -> Iterator[str]:
    """Documents in order: a .txt (or built-in .py) file is one; a .jsonl line is one.

    Files that are not valid UTF-8 are skipped, summed up in one line at the end (`skipped_line`); a
    .jsonl line that is not JSON or lacks `text_field` is an error naming the file and line.
    """
    skipped: list[tuple[Path, str]] = []
    for f in files:
        try:
            text = f.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            skipped.append((f, f"{e.reason} at byte {e.start}"))
            continue
        if f.suffix != ".jsonl":
            if text:
                yield text
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{f}:{lineno}: not valid JSON ({e.msg})") from None
            value = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(value, str):
                raise DataError(f"{f}:{lineno}: no string field {text_field!r}; set data.text_field")
            if value:
                yield value
    if skipped:
        print(skipped_line(skipped), file=sys.stderr, flush=True)


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
