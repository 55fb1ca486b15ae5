"""Readers: the input files as units of work, and each unit's records.

A `Unit` is a piece of one file that can be read on its own: a .txt file (one document), a byte range of
whole lines of a .jsonl file (a .jsonl.gz or .jsonl.zst file whole: they cannot be seeked), a Parquet row
group, an Arrow record batch. Units come from the files alone (not from the number of workers), so
tokenising them in parallel and concatenating in unit order gives the same bytes as one process.

A record that cannot be used (not UTF-8, not JSON, not an object, no string in the text field) is counted
in a `BadRecords` and skipped; `BadRecords.check` fails the run when more than a fraction of them are bad.
A text column that is missing from, or not a string in, a Parquet/Arrow schema is a `ConfigError` (the
whole file is unusable: data.text_field is wrong), not a bad record per row.

.parquet and .arrow need pyarrow, .jsonl.zst needs zstandard (the [data] extra), imported on first use.
A `datasets` folder (`Dataset.save_to_disk`) is read as its .arrow files, with pyarrow only.
"""

from __future__ import annotations

import glob
import contextlib
import gzip
import json
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from shardlm.errors import ConfigError, DataError
from shardlm.extras import require

BUILTIN = "builtin:stdlib"
SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".arrow")
SUPPORTED = ".txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, .arrow or a `datasets` save_to_disk folder"
ARROW_MAGIC = b"ARROW1"  # the Arrow IPC file format starts with it; the stream format does not


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


# -- which files ----------------------------------------------------------------------------------------
def resolve_sources(spec: str, what: str = "data.path") -> list[Path]:
    """The files `data.path` names, in a deterministic order: sorted by path, a `datasets` folder's .arrow
    files in its state.json order at the folder's place; the stdlib's .py files for builtin:stdlib. `what`
    names the setting in the errors (`shardlm prepare`: its SOURCE arguments)."""
    if spec == BUILTIN:
        return builtin_files()
    path = Path(spec)
    if any(c in spec for c in "*?["):
        found = [Path(p) for p in glob.glob(spec, recursive=True)]
        sources = sorted(p for p in found if (p.is_file() and _supported(p)) or (p.is_dir() and _is_hf_dataset(p)))
    elif path.is_dir():
        sources = _walk(path)
    elif path.is_file():
        if not _supported(path):
            raise ConfigError(f"{what} {spec!r}: unsupported file type; use {SUPPORTED}")
        sources = [path]
    else:
        store = "a token store (store:DIR), " if what == "data.path" else ""
        raise ConfigError(f"{what} {spec!r} does not exist; pass {store}a file ({SUPPORTED}), a directory, a glob "
                          f"or {BUILTIN}")
    files: list[Path] = []
    for s in sources:
        files += _hf_dataset_files(s) if s.is_dir() else [s]
    files = list(dict.fromkeys(files))  # a glob can name a `datasets` folder and its files: keep the first
    if not files:
        raise ConfigError(f"{what} {spec!r} holds no data files ({SUPPORTED})")
    return files


def _supported(path: Path) -> bool:
    return path.name.endswith(SUFFIXES)


def _is_hf_dataset(d: Path) -> bool:
    """A `Dataset.save_to_disk` folder: state.json and dataset_info.json."""
    return (d / "state.json").is_file() and (d / "dataset_info.json").is_file()


def _check_not_dataset_dict(d: Path) -> None:
    if (d / "dataset_dict.json").is_file():
        try:
            splits = json.loads((d / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            splits = sorted(p.name for p in d.iterdir() if p.is_dir() and _is_hf_dataset(p))
        raise ConfigError(f"{d} is a `datasets` DatasetDict (splits: {', '.join(map(str, splits))}); "
                          f"set data.path to one split's folder, e.g. {d / str(splits[0] if splits else 'train')}")


def _walk(root: Path) -> list[Path]:
    """The supported files under `root` and the `datasets` folders (each one source), sorted by path."""
    _check_not_dataset_dict(root)
    if _is_hf_dataset(root):
        return [root]
    sources = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for d in sorted(dirnames):
            _check_not_dataset_dict(here / d)
        sources += [here / d for d in dirnames if _is_hf_dataset(here / d)]
        dirnames[:] = sorted(d for d in dirnames if not _is_hf_dataset(here / d))
        sources += [here / f for f in filenames if _supported(here / f)]
    return sorted(sources)


def _hf_dataset_files(d: Path) -> list[Path]:
    """A `datasets` folder's .arrow files in state.json's `_data_files` order."""
    try:
        state = json.loads((d / "state.json").read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{d / 'state.json'}: no `_data_files` list ({type(e).__name__}: {e}); "
                          f"save the dataset again with Dataset.save_to_disk") from None
    files = [d / n for n in names]
    for f in files:
        if not f.is_file():
            raise ConfigError(f"{d / 'state.json'} lists {f.name}, which is missing; save the dataset again")
    return files


# -- units of work --------------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class Unit:
    """A piece of one file, readable on its own (picklable; ordered by its fields)."""

    path: str
    kind: str  # "text" (the whole file is one record) | "jsonl" | "parquet" | "arrow"
    part: int  # row group (parquet), record batch (arrow), byte range index (jsonl), 0 (text)
    start: int = 0  # jsonl: the byte range [start, stop) of whole lines (stop -1: to the end); others 0, -1
    stop: int = -1
    first_line: int = 1  # 1-based number, in the whole file, of the unit's first line (jsonl) or row (parquet, arrow)


def plan_units(files: list[Path], chunk_bytes: int = 64 << 20) -> list[Unit]:
    """The units of `files`, in file order. A plain .jsonl larger than `chunk_bytes` is cut into ranges of
    about `chunk_bytes` that start right after a newline (one sequential read counts the lines before
    each cut); .jsonl.gz/.zst are one unit each; Parquet one per row group; Arrow one per record batch."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    units = []
    for f in files:
        p, name = str(f), f.name
        if name.endswith((".txt", ".py")):
            units.append(Unit(p, "text", 0))
        elif name.endswith(".jsonl"):
            units += [Unit(p, "jsonl", i, a, b, line) for i, (a, b, line) in enumerate(_jsonl_ranges(f, chunk_bytes))]
        elif name.endswith((".jsonl.gz", ".jsonl.zst")):
            units.append(Unit(p, "jsonl", 0))
        elif name.endswith(".parquet"):
            units += [Unit(p, "parquet", i, first_line=row) for i, row in enumerate(_parquet_row_groups(f))]
        elif name.endswith(".arrow"):
            units += [Unit(p, "arrow", i, first_line=row) for i, row in enumerate(_arrow_batches(f))]
        else:
            raise ConfigError(f"{f}: unsupported file type; use {SUPPORTED}")
    return units


def _jsonl_ranges(path: Path, chunk_bytes: int, block: int = 1 << 20) -> list[tuple[int, int, int]]:
    """(start, stop, first line) of each byte range; one range (0, -1, 1) when the file is small."""
    size = path.stat().st_size
    if size <= chunk_bytes:
        return [(0, -1, 1)]
    cuts = [(0, 1)]  # (byte offset right after a newline, its 1-based line number)
    look = chunk_bytes - 1  # the next cut follows the first newline at or after this offset
    pos = lines = 0  # the current block's offset; the newlines before it
    with open(path, "rb") as fh:
        while data := fh.read(block):
            while look - pos < len(data):
                j = data.find(b"\n", max(look - pos, 0))
                if j < 0 or pos + j + 1 >= size:
                    break
                cuts.append((pos + j + 1, 1 + lines + data.count(b"\n", 0, j + 1)))
                look = pos + j + chunk_bytes
            lines += data.count(b"\n")
            pos += len(data)
    if len(cuts) == 1:
        return [(0, -1, 1)]
    stops = [c for c, _ in cuts[1:]] + [size]
    return [(start, stop, line) for (start, line), stop in zip(cuts, stops)]


def _parquet_row_groups(path: Path) -> list[int]:
    """The 1-based number of each row group's first row."""
    pa = require("pyarrow", "data", "reading .parquet files")
    pq = require("pyarrow.parquet", "data", "reading .parquet files")
    try:
        with pq.ParquetFile(path) as pf:
            meta = pf.metadata
    except (OSError, ValueError, pa.ArrowException) as e:  # not a Parquet file, truncated
        raise DataError(f"{path}: not a readable Parquet file ({e}); fix or remove it") from None
    return _firsts(meta.row_group(i).num_rows for i in range(meta.num_row_groups))


def _arrow_batches(path: Path) -> list[int]:
    """The 1-based number of each record batch's first row (file or stream format)."""
    pa = require("pyarrow", "data", "reading .arrow files")
    try:
        with _open_arrow(path) as batches:
            return _firsts(b.num_rows for b in batches)
    except (OSError, ValueError, pa.ArrowException) as e:  # not Arrow IPC, truncated
        raise DataError(f"{path}: not a readable Arrow IPC file ({e}); fix or remove it") from None


def _firsts(counts) -> list[int]:
    out, row = [], 1
    for n in counts:
        out.append(row)
        row += n
    return out


class _open_arrow:
    """`with _open_arrow(path) as batches`: the record batches of an Arrow IPC file or stream, memory-mapped.
    `batches` iterates them; `.get(i)` is batch i (random access in the file format, skipping in a stream)."""

    def __init__(self, path: Path):
        self.pa = require("pyarrow", "data", "reading .arrow files")
        require("pyarrow.ipc", "data", "reading .arrow files")
        self.path = path

    def __enter__(self):
        self.source = self.pa.memory_map(str(self.path))
        try:
            if self.source.read(len(ARROW_MAGIC)) == ARROW_MAGIC:
                self.reader = self.pa.ipc.open_file(self.source)
            else:
                self.source.seek(0)
                self.reader = self.pa.ipc.open_stream(self.source)
        except BaseException:
            self.source.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.source.close()

    def __iter__(self):
        if isinstance(self.reader, self.pa.ipc.RecordBatchFileReader):
            return (self.reader.get_batch(i) for i in range(self.reader.num_record_batches))
        return iter(self.reader)

    def get(self, i: int):
        if isinstance(self.reader, self.pa.ipc.RecordBatchFileReader):
            return self.reader.get_batch(i)
        for j, b in enumerate(self.reader):
            if j == i:
                return b
        raise DataError(f"{self.path}: has no record batch {i} (changed since it was planned?); run again")

    @property
    def schema(self):
        return self.reader.schema


# -- bad records ----------------------------------------------------------------------------------------
@dataclass
class BadRecords:
    """Records seen and the bad ones skipped, by reason, with the first `keep` examples as
    "location (reason)". Merge per-unit counts in unit order for a deterministic result."""

    total: int = 0
    bad: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)
    keep: int = field(default=5, compare=False)

    def add_good(self, n: int = 1) -> None:
        self.total += n

    def add_bad(self, where: str, reason: str, detail: str = "") -> None:
        """Count one bad record under `reason` (e.g. "not valid JSON"); `detail` only goes into the example."""
        self.total += 1
        self.bad += 1
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        if len(self.examples) < self.keep:
            self.examples.append(f"{where} ({reason}: {detail})" if detail else f"{where} ({reason})")

    def merge(self, other: BadRecords) -> None:
        self.total += other.total
        self.bad += other.bad
        for reason, n in other.by_reason.items():
            self.by_reason[reason] = self.by_reason.get(reason, 0) + n
        self.examples = (self.examples + other.examples)[: self.keep]

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "bad": self.bad, "by_reason": dict(self.by_reason),
                "examples": list(self.examples)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BadRecords:
        return cls(int(d["total"]), int(d["bad"]), dict(d["by_reason"]), list(d["examples"]))

    def _examples(self) -> str:
        return ", ".join(self.examples) + (", ..." if self.bad > len(self.examples) else "")

    def line(self) -> str | None:
        """None when nothing is bad, else "data: 3 of 12,345 records skipped (2 missing field 'text', 1 not
        valid JSON): a.jsonl:12 (not valid JSON: ...), ..." (reasons by count, then first seen)."""
        if not self.bad:
            return None
        reasons = sorted(self.by_reason.items(), key=lambda kv: -kv[1])  # stable: ties keep first-seen order
        why = ", ".join(f"{n:,} {reason}" for reason, n in reasons)
        return f"data: {self.bad:,} of {self.total:,} records skipped ({why}): {self._examples()}"

    def check(self, max_fraction: float) -> None:
        """Raise a one-line DataError when more than `max_fraction` of the records are bad."""
        if self.total and self.bad / self.total > max_fraction:
            raise DataError(f"data: {self.bad:,} of {self.total:,} records are bad ({self.bad / self.total:.2%}, more "
                            f"than data.max_bad_fraction={max_fraction:g}): {self._examples()}; fix the data or "
                            f"raise data.max_bad_fraction")


# -- reading a unit -------------------------------------------------------------------------------------
def read_texts(unit: Unit, text_field: str, bad: BadRecords) -> Iterator[str]:
    """The unit's documents, in order. A bad record (see the module docstring) goes to `bad` and is
    skipped; an empty text is a good record that yields nothing. Locations: "path" (text), "path:LINE"
    (jsonl, 1-based in the whole file), "path row N" (parquet, arrow; 1-based in the whole file)."""
    if unit.kind == "text":
        try:
            text = Path(unit.path).read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            bad.add_bad(unit.path, "not valid UTF-8", f"{e.reason} at byte {e.start}")
            return
        bad.add_good()
        if text:
            yield text
        return
    if unit.kind == "jsonl":
        for record, where in _json_records(unit, bad):
            value = record.get(text_field)
            if value is None:
                bad.add_bad(where, f"{'missing field' if text_field not in record else 'null'} {text_field!r}")
            elif not isinstance(value, str):
                bad.add_bad(where, f"non-string {text_field!r}", type(value).__name__)
            else:
                bad.add_good()
                if value:
                    yield value
        return
    for row, value in enumerate(_pylist(unit, text_field), unit.first_line):
        if value is None:
            bad.add_bad(f"{unit.path} row {row}", f"null {text_field!r}")
        else:
            bad.add_good()
            if value:
                yield value


def read_records(unit: Unit, bad: BadRecords) -> Iterator[tuple[dict, str]]:
    """(record, location) for each record of the unit, in order (for SFT). A line that is not UTF-8, not
    JSON or not an object goes to `bad` and is skipped. A text file has no records: a ConfigError."""
    if unit.kind == "text":
        raise ConfigError(f"{unit.path}: a text file has no records; use .jsonl(.gz/.zst), .parquet or .arrow")
    if unit.kind == "jsonl":
        for record, where in _json_records(unit, bad):
            bad.add_good()
            yield record, where
        return
    for row, record in enumerate(_pylist(unit, None), unit.first_line):
        bad.add_good()
        yield record, f"{unit.path} row {row}"


def _json_records(unit: Unit, bad: BadRecords) -> Iterator[tuple[dict, str]]:
    """(object, "path:LINE") for the unit's non-blank lines that are JSON objects; the others go to `bad`."""
    for lineno, raw in enumerate(_lines(unit), unit.first_line):
        if not raw.strip():
            continue
        where = f"{unit.path}:{lineno}"
        try:
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a BOM at the file's start is no content
        except UnicodeDecodeError as e:
            bad.add_bad(where, "not valid UTF-8", f"{e.reason} at byte {e.start}")
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            bad.add_bad(where, "not valid JSON", f"{e.msg} at column {e.colno}")
            continue
        except (ValueError, RecursionError) as e:
            bad.add_bad(where, "not valid JSON", type(e).__name__)
            continue
        if not isinstance(record, dict):
            bad.add_bad(where, "not a JSON object", type(record).__name__)
            continue
        yield record, where


def _lines(unit: Unit) -> Iterator[bytes]:
    """The unit's lines as bytes (newline kept): its byte range of a .jsonl, all of a .jsonl.gz/.zst."""
    path = Path(unit.path)
    if path.name.endswith(".jsonl"):
        with open(path, "rb") as fh:
            fh.seek(unit.start)
            pos = unit.start
            for raw in fh:
                if 0 <= unit.stop <= pos:
                    return
                pos += len(raw)
                yield raw
        return
    if path.name.endswith(".gz"):
        errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
        opened: Any = gzip.open(path, "rb")
    else:
        zstd = require("zstandard", "data", "reading .jsonl.zst files")
        errors = (OSError, EOFError, zstd.ZstdError)
        opened = contextlib.closing(_split_lines(_zstd_chunks(zstd, open(path, "rb"))))
    try:
        with opened as lines:
            yield from lines
    except errors as e:
        raise DataError(f"{path}: cannot decompress ({type(e).__name__}: {e}); the file is truncated or "
                        f"corrupt: fix or remove it") from None


def _zstd_chunks(zstd, fh: BinaryIO, size: int = 1 << 20) -> Iterator[bytes]:
    """The decompressed bytes of every frame of a .zst file, in order. A file that ends inside a frame is an
    error (EOFError): zstandard's stream reader returns what it could decode and stops without a word."""
    with fh:
        d, fed = zstd.ZstdDecompressor().decompressobj(), False
        while chunk := fh.read(size):
            while chunk:
                out = d.decompress(chunk)
                fed = True
                if out:
                    yield out
                chunk = d.unused_data if d.eof else b""
                if d.eof:  # a frame ended: the rest of this chunk starts the next one
                    d, fed = zstd.ZstdDecompressor().decompressobj(), False
        if fed and not d.eof:
            raise EOFError("the file ends inside a zstd frame")


def _split_lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Lines (newline kept) of a stream of byte chunks."""
    rest = b""
    for chunk in chunks:
        *whole, rest = (rest + chunk).split(b"\n")
        for line in whole:
            yield line + b"\n"
    if rest:
        yield rest


def _pylist(unit: Unit, text_field: str | None) -> list:
    """The unit's row group / record batch as Python values: the `text_field` column's values (str or None),
    or, with `text_field` None, every row as a dict. Converted while the file is open (Arrow is mapped)."""
    if unit.kind == "parquet":
        pq = require("pyarrow.parquet", "data", "reading .parquet files")
        with pq.ParquetFile(unit.path) as pf:
            if text_field is None:
                return pf.read_row_group(unit.part).to_pylist()
            _check_text_column(unit.path, pf.schema_arrow, text_field)
            return pf.read_row_group(unit.part, columns=[text_field]).column(0).to_pylist()
    if unit.kind == "arrow":
        with _open_arrow(Path(unit.path)) as batches:
            if text_field is None:
                return batches.get(unit.part).to_pylist()
            _check_text_column(unit.path, batches.schema, text_field)
            return batches.get(unit.part).column(text_field).to_pylist()
    raise ValueError(f"unknown unit kind {unit.kind!r}")


def _check_text_column(path: str, schema, text_field: str) -> None:
    pa = require("pyarrow", "data", "reading .parquet/.arrow files")
    if schema.get_field_index(text_field) < 0:
        raise ConfigError(f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)}); "
                          f"set data.text_field")
    t = schema.field(text_field).type
    if pa.types.is_dictionary(t):
        t = t.value_type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
        raise ConfigError(f"{path}: column {text_field!r} holds {t}, not strings; set data.text_field to a "
                          f"text column")


__all__ = ["SUFFIXES", "BadRecords", "Unit", "plan_units", "read_records", "read_texts", "resolve_sources"]
