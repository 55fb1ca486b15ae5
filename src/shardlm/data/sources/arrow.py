"""Arrow IPC files (.arrow, the file or the stream format): one unit per record batch, memory-mapped; the
text column is data.text_field. Needs pyarrow (the [data] extra), imported on first use."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from shardlm.data.sources.base import (BadRecords, Reader, Unit, check_text_column, column_records, column_texts,
                                       first_rows)
from shardlm.errors import DataError
from shardlm.extras import require

ARROW_MAGIC = b"ARROW1"  # the Arrow IPC file format starts with it; the stream format does not


class ArrowReader(Reader):
    """A record batch is a unit, a row a record; a null text is a bad record."""

    name = "arrow"
    suffixes = (".arrow",)

    def units(self, path: Path, chunk_bytes: int) -> list[Unit]:
        return [Unit(str(path), self.name, i, first_line=row) for i, row in enumerate(_batches(path))]

    def texts(self, unit: Unit, text_field: str, bad: BadRecords) -> Iterator[str]:
        with open_arrow(Path(unit.path)) as batches:  # converted while the file is open (it is mapped)
            check_text_column(unit.path, batches.schema, text_field)
            values = batches.get(unit.part).column(text_field).to_pylist()
        yield from column_texts(unit, values, text_field, bad)

    def records(self, unit: Unit, bad: BadRecords) -> Iterator[tuple[dict, str]]:
        with open_arrow(Path(unit.path)) as batches:
            rows = batches.get(unit.part).to_pylist()
        yield from column_records(unit, rows, bad)


def _batches(path: Path) -> list[int]:
    """The 1-based number of each record batch's first row (file or stream format)."""
    pa = require("pyarrow", "data", "reading .arrow files")
    try:
        with open_arrow(path) as batches:
            return first_rows(b.num_rows for b in batches)
    except (OSError, ValueError, pa.ArrowException) as e:  # not Arrow IPC, truncated
        raise DataError(f"{path}: not a readable Arrow IPC file ({e}); fix or remove it") from None


class open_arrow:
    """`with open_arrow(path) as batches`: the record batches of an Arrow IPC file or stream, memory-mapped.
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
