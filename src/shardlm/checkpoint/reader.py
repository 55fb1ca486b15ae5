"""Offline reads of one of our DCP checkpoints: one process, no process group, a few tensors at a time.

`CheckpointReader(step_dir)` lists the `model.*` tensors (name without `model.` -> shape, dtype) from the
metadata alone and reads whole tensors on request with `dcp.load(no_dist=True)`; `.metadata` is parsed
once however many reads follow. Used by the HF / peft export. A QLoRA base weight, stored as its NF4
pieces, is listed and read as the bf16 weight it dequantises to.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardlm.checkpoint.manager import SafeLoadPlanner, read_keys
from shardlm.errors import CheckpointError
from shardlm.quant.nf4 import NF4_KEY, from_pieces

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
    """The model tensors of a complete checkpoint folder; CheckpointError if it is not one."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        read_keys(self.path)  # the one completeness / readability check (CheckpointError)
        self._reader = _CachedReader(str(self.path))
        md = self._reader.read_metadata()
        self.tensors: dict[str, TensorInfo] = {}
        self._stored: dict[str, TensorInfo] = {}  # what the files hold, NF4 pieces included
        for key, m in md.state_dict_metadata.items():
            if not key.startswith(_MODEL):
                continue
            if not isinstance(m, TensorStorageMetadata):
                raise CheckpointError(f"{self.path}: {key!r} is not a tensor")
            self._stored[key[len(_MODEL):]] = TensorInfo(tuple(m.size), m.properties.dtype)
        # A QLoRA base weight is stored as its NF4 pieces (shardlm.quant.nf4.nf4_pieces): listed here as the
        # bf16 weight they stand for, and read dequantised.
        self.nf4: dict[str, dict[str, str]] = {}
        for name in self._stored:
            base, sep, piece = name.rpartition(NF4_KEY)
            if sep:
                self.nf4.setdefault(base, {})[piece] = name
        shapes = self._read_stored([v["shape"] for v in self.nf4.values() if "shape" in v])
        for name, info in self._stored.items():
            if NF4_KEY not in name:
                self.tensors[name] = info
        for base, pieces in self.nf4.items():
            if set(pieces) != {"data", "scalers", "factors", "mean", "shape"}:
                raise CheckpointError(f"{self.path}: NF4 weight {base!r} is incomplete (has {sorted(pieces)})")
            self.tensors[base] = TensorInfo(tuple(int(n) for n in shapes[pieces["shape"]].tolist()), torch.bfloat16)
        if not self.tensors:
            raise CheckpointError(f"{self.path}: no model.* tensors in this checkpoint")

    def _read_stored(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        out = {n: torch.empty(self._stored[n].shape, dtype=self._stored[n].dtype) for n in names}
        if out:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
                dcp.load({"model": out}, storage_reader=self._reader, planner=SafeLoadPlanner(), no_dist=True)
        return out

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Full tensors `names` (ours, no `model.` prefix), in the dtype they were saved in (an NF4 weight:
        dequantised, bf16)."""
        names = list(names)
        plain = [n for n in names if n not in self.nf4]
        pieces = [p for n in names if n in self.nf4 for p in self.nf4[n].values()]
        got = self._read_stored(plain + pieces)
        if pieces:
            for n in names:
                if n in self.nf4:
                    got[n] = from_pieces({k: got.pop(v) for k, v in self.nf4[n].items()})
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
