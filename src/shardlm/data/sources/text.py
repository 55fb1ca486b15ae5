"""Plain text files (.txt): each file is one document, read whole."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from shardlm.data.sources.base import BadRecords, Reader, Unit


class TextReader(Reader):
    """A .txt file is one unit and one document; a file that is not UTF-8 is one bad record."""

    name = "text"
    suffixes = (".txt",)

    def texts(self, unit: Unit, text_field: str, bad: BadRecords) -> Iterator[str]:
        try:
            text = Path(unit.path).read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            bad.add_bad(unit.path, "not valid UTF-8", f"{e.reason} at byte {e.start}")
            return
        bad.add_good()
        if text:
            yield text
