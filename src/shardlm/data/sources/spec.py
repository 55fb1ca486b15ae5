"""data.path or [[data.sources]], parsed once into a typed list: every caller takes `parse_sources`'s result."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # the annotation only: prepare's worker processes need not import the config schema
    from shardlm.config import DataSection


class SourceEntry(NamedTuple):
    """One source of the run's text: data.path, or one [[data.sources]] entry (its text_field filled in from
    data.text_field). A NamedTuple: it also unpacks as (path, weight, epochs, text_field)."""

    path: str
    weight: float
    epochs: float | None
    text_field: str


def parse_sources(data: DataSection) -> list[SourceEntry]:
    """The sources of data.path (one, weight 1, no epochs cap) or of each [[data.sources]] entry."""
    if not data.sources:
        return [SourceEntry(data.path, 1.0, None, data.text_field)]
    return [SourceEntry(s.path, s.weight, s.epochs, s.text_field or data.text_field) for s in data.sources]
