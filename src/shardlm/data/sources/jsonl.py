"""JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst): one JSON object per line, the text in data.text_field.

A plain .jsonl larger than the unit size is cut into byte ranges of whole lines (one sequential read counts
the lines before each cut, so locations stay "path:LINE" of the whole file); a compressed file is one unit
(it cannot be seeked). .jsonl.zst needs zstandard (the [data] extra), imported on first use.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from shardlm.data.sources.base import BadRecords, Reader, Unit
from shardlm.errors import DataError
from shardlm.extras import require


class JsonlReader(Reader):
    """Each non-blank line is a record; lines that are not UTF-8, not JSON or not an object are bad records."""

    name = "jsonl"
    suffixes = (".jsonl", ".jsonl.gz", ".jsonl.zst")

    def units(self, path: Path, chunk_bytes: int) -> list[Unit]:
        if not path.name.endswith(".jsonl"):
            return [Unit(str(path), self.name, 0)]
        return [Unit(str(path), self.name, i, a, b, line)
                for i, (a, b, line) in enumerate(_jsonl_ranges(path, chunk_bytes))]

    def texts(self, unit: Unit, text_field: str, bad: BadRecords) -> Iterator[str]:
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

    def records(self, unit: Unit, bad: BadRecords) -> Iterator[tuple[dict, str]]:
        for record, where in _json_records(unit, bad):
            bad.add_good()
            yield record, where


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
        yield from _range_lines(path, unit.start, unit.stop)
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


def _range_lines(path: Path, start: int, stop: int) -> Iterator[bytes]:
    """The lines of a plain file's byte range [start, stop) (stop -1: to the end)."""
    with open(path, "rb") as fh:
        fh.seek(start)
        pos = start
        for raw in fh:
            if 0 <= stop <= pos:
                return
            pos += len(raw)
            yield raw


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
