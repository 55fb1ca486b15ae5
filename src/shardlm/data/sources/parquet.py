"""Parquet files (.parquet): one unit per row group; the text column is data.text_field. Needs pyarrow
(the [data] extra), imported on first use."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from shardlm.data.sources.base import (BadRecords, Reader, Unit, check_text_column, column_records, column_texts,
                                       first_rows)
from shardlm.errors import DataError
from shardlm.extras import require


class ParquetReader(Reader):
    """A row group is a unit, a row a record; a null text is a bad record."""

    name = "parquet"
    suffixes = (".parquet",)

    def units(self, path: Path, chunk_bytes: int) -> list[Unit]:
        return [Unit(str(path), self.name, i, first_line=row) for i, row in enumerate(_row_groups(path))]

    def texts(self, unit: Unit, text_field: str, bad: BadRecords) -> Iterator[str]:
        pq = require("pyarrow.parquet", "data", "reading .parquet files")
        with pq.ParquetFile(unit.path) as pf:
            check_text_column(unit.path, pf.schema_arrow, text_field)
            values = pf.read_row_group(unit.part, columns=[text_field]).column(0).to_pylist()
        yield from column_texts(unit, values, text_field, bad)

    def records(self, unit: Unit, bad: BadRecords) -> Iterator[tuple[dict, str]]:
        pq = require("pyarrow.parquet", "data", "reading .parquet files")
        with pq.ParquetFile(unit.path) as pf:
            rows = pf.read_row_group(unit.part).to_pylist()
        yield from column_records(unit, rows, bad)


def _row_groups(path: Path) -> list[int]:
    """The 1-based number of each row group's first row."""
    pa = require("pyarrow", "data", "reading .parquet files")
    pq = require("pyarrow.parquet", "data", "reading .parquet files")
    try:
        with pq.ParquetFile(path) as pf:
            meta = pf.metadata
    except (OSError, ValueError, pa.ArrowException) as e:  # not a Parquet file, truncated
        raise DataError(f"{path}: not a readable Parquet file ({e}); fix or remove it") from None
    return first_rows(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
