"""THE list of input formats, and what goes through it: which files data.path names (`resolve_sources`),
their units (`plan_units`), a unit's documents and records (`read_texts`, `read_records`), all documents in
order (`iter_documents`). A new format is one module with a `Reader` subclass and one entry in READERS."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from pathlib import Path

from shardlm.data.sources.arrow import ArrowReader
from shardlm.data.sources.base import BadRecords, Reader, Unit
from shardlm.data.sources.builtin import BUILTIN, BuiltinReader, is_stdlib, skipped_line
from shardlm.data.sources.hf_datasets import HFDatasetReader
from shardlm.data.sources.jsonl import JsonlReader
from shardlm.data.sources.parquet import ParquetReader
from shardlm.data.sources.text import TextReader
from shardlm.errors import ConfigError, say

READERS: tuple[Reader, ...] = (TextReader(), JsonlReader(), ParquetReader(), ArrowReader(), HFDatasetReader(),
                               BuiltinReader())

SUFFIXES = tuple(s for r in READERS if r.listed for s in r.suffixes)
SUPPORTED = ", ".join(SUFFIXES) + "".join(f" or {r.folder_words}" for r in READERS if r.folder_words)
_BY_NAME = {r.name: r for r in reversed(READERS)}  # the first reader of a name reads its units


def reader_for(path: Path) -> Reader | None:
    """The reader of a file (any reader, listed or not), by its name; None when no format claims it."""
    return next((r for r in READERS if r.reads(path)), None)


def _listed(path: Path) -> bool:
    return path.name.endswith(SUFFIXES)


def _folder_reader(d: Path) -> Reader | None:
    return next((r for r in READERS if r.is_folder(d)), None)


def _check_folder(d: Path) -> None:
    for r in READERS:
        r.check_folder(d)


# -- which files ----------------------------------------------------------------------------------------
def resolve_sources(spec: str, what: str = "data.path") -> list[Path]:
    """The files `data.path` names, in a deterministic order: sorted by path, a folder source's files (a
    `datasets` folder's .arrow files in its state.json order) at the folder's place; a named source's files
    (builtin:stdlib: the stdlib's .py files). `what` names the setting in the errors (`shardlm prepare`: its
    SOURCE arguments). A clear error when there are none."""
    named = next((r for r in READERS if spec in r.names), None)
    if named is not None:
        return named.files(spec)
    files: list[Path] = []
    for s in _sources(spec, what):
        folder = _folder_reader(s) if s.is_dir() else None
        files += folder.files(str(s)) if folder is not None else [s]
    files = list(dict.fromkeys(files))  # a glob can name a `datasets` folder and its files: keep the first
    if not files:
        raise ConfigError(f"{what} {spec!r} holds no data files ({SUPPORTED})")
    return files


resolve_files = resolve_sources  # the name `shardlm.data` exports


def _sources(spec: str, what: str) -> list[Path]:
    """The files and folder sources a glob, a folder or a file names, sorted by path."""
    path = Path(spec)
    if any(c in spec for c in "*?["):
        found = [Path(p) for p in glob.glob(spec, recursive=True)]
        return sorted(p for p in found if (p.is_file() and _listed(p)) or (p.is_dir() and _folder_reader(p)))
    if path.is_dir():
        return _walk(path)
    if path.is_file():
        if not _listed(path):
            raise ConfigError(f"{what} {spec!r}: unsupported file type; use {SUPPORTED}")
        return [path]
    store = "a token store (store:DIR), " if what == "data.path" else ""
    raise ConfigError(f"{what} {spec!r} does not exist; pass {store}a file ({SUPPORTED}), a directory, a glob "
                      f"or {BUILTIN}")


def _walk(root: Path) -> list[Path]:
    """The listed files under `root` and the folder sources (each one source), sorted by path."""
    _check_folder(root)
    if _folder_reader(root):
        return [root]
    sources = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for d in sorted(dirnames):
            _check_folder(here / d)
        sources += [here / d for d in dirnames if _folder_reader(here / d)]
        dirnames[:] = sorted(d for d in dirnames if not _folder_reader(here / d))
        sources += [here / f for f in filenames if _listed(here / f)]
    return sorted(sources)


# -- units and their contents ---------------------------------------------------------------------------
def plan_units(files: list[Path], chunk_bytes: int = 64 << 20) -> list[Unit]:
    """The units of `files`, in file order (each format's `Reader.units`: a plain .jsonl larger than
    `chunk_bytes` is cut into ranges of about `chunk_bytes` that start right after a newline; .jsonl.gz/.zst
    are one unit each; Parquet one per row group; Arrow one per record batch; a text file one)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    units = []
    for f in files:
        reader = reader_for(f)
        if reader is None:
            raise ConfigError(f"{f}: unsupported file type; use {SUPPORTED}")
        units += reader.units(f, chunk_bytes)
    return units


def _reader_of(unit: Unit) -> Reader:
    if unit.kind not in _BY_NAME:
        raise ValueError(f"unknown unit kind {unit.kind!r}")
    return _BY_NAME[unit.kind]


def read_texts(unit: Unit, text_field: str, bad: BadRecords) -> Iterator[str]:
    """The unit's documents, in order. A bad record goes to `bad` and is skipped; an empty text is a good
    record that yields nothing. Locations: "path" (text), "path:LINE" (jsonl, 1-based in the whole file),
    "path row N" (parquet, arrow; 1-based in the whole file). A text column missing from, or not a string
    in, a Parquet/Arrow schema is a ConfigError (data.text_field is wrong)."""
    yield from _reader_of(unit).texts(unit, text_field, bad)


def read_records(unit: Unit, bad: BadRecords) -> Iterator[tuple[dict, str]]:
    """(record, location) for each record of the unit, in order (for SFT). A line that is not UTF-8, not
    JSON or not an object goes to `bad` and is skipped. A text file has no records: a ConfigError."""
    yield from _reader_of(unit).records(unit, bad)


def iter_documents(files: list[Path], text_field: str, max_bad_fraction: float = 0.001) -> Iterator[str]:
    """Documents in order: a .txt (or built-in .py) file is one; a .jsonl line or a Parquet/Arrow row is one.

    Bad records (not UTF-8, not JSON, no string `text_field`) are skipped and summed up in one line at the
    end; a DataError at the end when more than `max_bad_fraction` of the records are bad. The stdlib's own
    files that are not UTF-8 are left out of that count: one note (`skipped_line`).
    """
    bad, skipped = BadRecords(), []
    for unit in plan_units(files):
        got = BadRecords()
        yield from read_texts(unit, text_field, got)
        if got.bad and is_stdlib(unit.path):
            skipped.append((Path(unit.path), got.examples[0]))
        else:
            bad.merge(got)
    if skipped:
        say(skipped_line(skipped))
    bad.check(max_bad_fraction)
    if line := bad.line():
        say(f"shardlm: warning: {line}")
