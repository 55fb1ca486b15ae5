"""Offline reads of one of our DCP checkpoints: one process, no process group, a few tensors at a time.

`CheckpointReader(step_dir, forms)` lists the `model.*` tensors (name without `model.` -> shape, dtype) from the
metadata alone and reads whole tensors on request with `dcp.load(no_dist=True)`; `.metadata` is parsed
once however many reads follow. Used by the HF / peft export. A parameter held in a stored form (a QLoRA
base weight: checkpoint/stored.py) is listed and read as the full tensor it stands for.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardlm.checkpoint.manager import SafeLoadPlanner, read_keys
from shardlm.checkpoint.stored import Pieces, StoredForm
from shardlm.errors import CheckpointError

SINGLE_PROCESS_WARNING = r".*torch\.distributed is disabled.*"  # dcp's no_dist notice, once per call
_MODEL = "model."


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _CachedReader(dcp.FileSystemReader):
    """A FileSystemReader that parses `.metadata` once, however many `dcp.load` calls use it."""

    _md = None

    def read_metadata(self, *args, **kwargs):
        if self._md is None:
            self._md = super().read_metadata(*args, **kwargs)
        return self._md


class CheckpointReader:
    """The model tensors of a complete checkpoint folder; CheckpointError if it is not one.

    `forms`: the stored forms (checkpoint/stored.py) its parameters may be held in; such a parameter is
    listed as the full tensor its pieces stand for and read reassembled. Without the right form, its pieces
    show as tensors of their own (which the export then rejects by name).
    """

    def __init__(self, path: str | Path, forms: Sequence[StoredForm] = ()):
        self.path = Path(path)
        read_keys(self.path)  # the one completeness / readability check (CheckpointError)
        self._reader = _CachedReader(str(self.path))
        md = self._reader.read_metadata()
        self._stored: dict[str, TensorInfo] = {}  # what the files hold, the pieces of stored forms included
        for key, m in md.state_dict_metadata.items():
            if not key.startswith(_MODEL):
                continue
            if not isinstance(m, TensorStorageMetadata):
                raise CheckpointError(f"{self.path}: {key!r} is not a tensor")
            self._stored[key[len(_MODEL):]] = TensorInfo(tuple(m.size), m.properties.dtype)
        # {name: its pieces} of the parameters held in a stored form, and that form
        self.encoded: dict[str, Pieces] = {}
        self._form: dict[str, StoredForm] = {}
        for form in forms:
            try:
                grouped = form.group(self._stored)
            except ValueError as e:
                raise CheckpointError(f"{self.path}: {e}") from None
            self.encoded.update(grouped)
            self._form.update(dict.fromkeys(grouped, form))
        pieces = {key for p in self.encoded.values() for key in p.values()}
        self.tensors: dict[str, TensorInfo] = {name: info for name, info in self._stored.items() if name not in pieces}
        self.tensors.update(self._describe())
        if not self.tensors:
            raise CheckpointError(f"{self.path}: no model.* tensors in this checkpoint")

    def _describe(self) -> dict[str, TensorInfo]:
        """The full tensors the stored forms' parameters stand for (their header pieces read in one go)."""
        heads = {name: {h: pieces[h] for h in self._form[name].header} for name, pieces in self.encoded.items()}
        got = self._read_stored([key for h in heads.values() for key in h.values()])
        return {name: TensorInfo(*self._form[name].describe({h: got[k] for h, k in head.items()}))
                for name, head in heads.items()}

    def _read_stored(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        out = {n: torch.empty(self._stored[n].shape, dtype=self._stored[n].dtype) for n in names}
        if out:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
                dcp.load({"model": out}, storage_reader=self._reader, planner=SafeLoadPlanner(), no_dist=True)
        return out

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Full tensors `names` (ours, no `model.` prefix), in the dtype they were saved in (one held in a
        stored form: reassembled, in its form's dtype)."""
        names = list(names)
        plain = [n for n in names if n not in self.encoded]
        pieces = [p for n in names if n in self.encoded for p in self.encoded[n].values()]
        got = self._read_stored(plain + pieces)
        for n in names:
            if n in self.encoded:
                got[n] = self._form[n].assemble({k: got.pop(v) for k, v in self.encoded[n].items()})
        return {n: got[n] for n in names}

    def batches(self, names: Iterable[str], max_bytes: int) -> Iterator[list[str]]:
        """`names` in order, grouped so each group holds at most `max_bytes` (one bigger tensor alone)."""
        batch, size = [], 0
        for n in names:
            b = self.tensors[n].nbytes
            if batch and size + b > max_bytes:
                yield batch
                batch, size = [], 0
            batch.append(n)
            size += b
        if batch:
            yield batch
