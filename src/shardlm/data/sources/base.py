"""The reader interface every input format implements, the unit of work it plans, and the bad-record count.

A `Unit` is a piece of one file that can be read on its own: a .txt file (one document), a byte range of
whole lines of a .jsonl file (a .jsonl.gz or .jsonl.zst file whole: they cannot be seeked), a Parquet row
group, an Arrow record batch. Units come from the files alone (not from the number of workers), so
tokenising them in parallel and concatenating in unit order gives the same bytes as one process.

A record that cannot be used (not UTF-8, not JSON, not an object, no string in the text field) is counted
in a `BadRecords` and skipped; `BadRecords.check` fails the run when more than a fraction of them are bad.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardlm.errors import ConfigError, DataError
from shardlm.extras import require


@dataclass(frozen=True, order=True)
class Unit:
    """A piece of one file, readable on its own (picklable; ordered by its fields)."""

    path: str
    kind: str  # the name of the Reader that reads it: "text" (the whole file is one record) | "jsonl" | ...
    part: int  # row group (parquet), record batch (arrow), byte range index (jsonl), 0 (text)
    start: int = 0  # jsonl: the byte range [start, stop) of whole lines (stop -1: to the end); others 0, -1
    stop: int = -1
    first_line: int = 1  # 1-based number, in the whole file, of the unit's first line (jsonl) or row (parquet, arrow)


class Reader:
    """One input format. A format module subclasses it and the registry (`sources.registry.READERS`) lists
    one instance: adding a format is one module and one registry entry.

    A reader names files by suffix (`suffixes`), a folder that is one source (`is_folder`, `folder_files`:
    a `datasets` save), or a named source (`names`: builtin:stdlib). It cuts a file into units (`units`) and
    reads a unit's documents (`texts`) or records (`records`, for SFT)."""

    name = ""  # the kind of its units
    suffixes: tuple[str, ...] = ()  # the file names it reads
    listed = True  # its files are found in data.path's folders and globs (False: only through its `names`)
    names: tuple[str, ...] = ()  # data.path values that name it (builtin:stdlib)
    folder_words = ""  # how the errors name a folder it reads ("a `datasets` save_to_disk folder")

    def reads(self, path: Path) -> bool:
        """A file of this format (by its name)."""
        return path.name.endswith(self.suffixes)

    def is_folder(self, d: Path) -> bool:
        """A folder that is one source of this format."""
        return False

    def check_folder(self, d: Path) -> None:
        """Raise a ConfigError for a folder that looks like this format's but cannot be read as data.path."""

    def files(self, spec: str) -> list[Path]:
        """The files a named source (`names`) or a folder of this format (`is_folder`) stands for, in order."""
        return [Path(spec)]

    def units(self, path: Path, chunk_bytes: int) -> list[Unit]:
        """The file's units, in order (default: the whole file is one)."""
        return [Unit(str(path), self.name, 0)]

    def texts(self, unit: Unit, text_field: str, bad: BadRecords) -> Iterator[str]:
        """The unit's documents, in order; a bad record goes to `bad` and is skipped; an empty text is a good
        record that yields nothing."""
        raise NotImplementedError

    def records(self, unit: Unit, bad: BadRecords) -> Iterator[tuple[dict, str]]:
        """(record, location) of each of the unit's records, in order (for SFT)."""
        raise ConfigError(f"{unit.path}: a text file has no records; use .jsonl(.gz/.zst), .parquet or .arrow")


def first_rows(counts: Iterable[int]) -> list[int]:
    """The 1-based number of each block's first row, from the blocks' row counts."""
    out, row = [], 1
    for n in counts:
        out.append(row)
        row += n
    return out


def column_texts(unit: Unit, values: list, text_field: str, bad: BadRecords) -> Iterator[str]:
    """A columnar unit's text column values (str or None) as documents: a null is a bad record."""
    for row, value in enumerate(values, unit.first_line):
        if value is None:
            bad.add_bad(f"{unit.path} row {row}", f"null {text_field!r}")
        else:
            bad.add_good()
            if value:
                yield value


def column_records(unit: Unit, rows: list[dict], bad: BadRecords) -> Iterator[tuple[dict, str]]:
    """A columnar unit's rows as (record, "path row N")."""
    for row, record in enumerate(rows, unit.first_line):
        bad.add_good()
        yield record, f"{unit.path} row {row}"


def check_text_column(path: str, schema, text_field: str) -> None:
    """A Parquet/Arrow schema's `text_field` must be a string column: a ConfigError otherwise (the whole file
    is unusable: data.text_field is wrong), not a bad record per row."""
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
