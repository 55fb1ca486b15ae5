"""Stored forms: parameters a checkpoint holds in another encoding than the tensor they stand for.

checkpoint/ knows no encoding itself: whoever builds the model hands in the forms its parameters may take
(`shardlm.build.STORED_FORMS`; today one, a QLoRA base weight in NF4: `shardlm.quant.nf4.NF4_FORM`). A
form turns such a parameter into plain tensors ("pieces", each under its own key) for DCP to save, groups
the keys of a checkpoint back into pieces, reassembles the full tensor offline, and fills the parameter
from the plain weight on an init load. A resume never loads them back: the build refills them (the
same bits) from model.init_from or the seed.

A protocol, not a base class: the encodings live below checkpoint/ (quant/) and must not import it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

Pieces = dict[str, str]  # piece name -> the key it is stored under (no `model.` prefix)


class StoredForm(Protocol):
    """One encoding of parameters in a checkpoint (see the module docstring)."""

    header: tuple[str, ...]  # the pieces `describe` needs (small: read for every parameter when a reader opens)

    def names(self, model: nn.Module) -> set[str]:
        """The model's parameters held in this form (saved as pieces, never loaded back by a resume)."""
        ...

    def to_stored(self, state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        """`model`'s state dict with each entry of this form replaced by the plain tensors it is saved as."""
        ...

    def group(self, keys: Iterable[str]) -> dict[str, Pieces]:
        """{parameter name: its pieces} of the stored `keys` that are pieces of this form; ValueError naming
        a parameter whose pieces are incomplete."""
        ...

    def describe(self, header: dict[str, torch.Tensor]) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of the full tensor whose `header` pieces these are."""
        ...

    def assemble(self, pieces: dict[str, torch.Tensor]) -> torch.Tensor:
        """The full tensor that whole `pieces` stand for (offline: the export reads it)."""
        ...

    def plain_like(self, model: nn.Module, name: str) -> torch.Tensor:
        """A plain tensor, sharded as `model`'s parameter `name`, that DCP reads its full weight into (an init
        load)."""
        ...

    def fill(self, model: nn.Module, plain: dict[str, torch.Tensor]) -> None:
        """Set the parameters named in `plain` (`plain_like` tensors, read) from those values, in place."""
        ...


def stored_names(model: nn.Module | None, forms: Iterable[StoredForm]) -> set[str]:
    """The names of `model`'s parameters held in one of `forms` (none without a model)."""
    return set() if model is None else {n for form in forms for n in form.names(model)}
