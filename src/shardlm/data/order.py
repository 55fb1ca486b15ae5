"""The global sample order every loader shares, and the loader interface the trainer uses.

Step s uses global samples [s*G, (s+1)*G) of a seeded per-epoch permutation of the rows,
G = micro_batch_size x grad_accum x dp. Within a step, micro-batch k of dp rank r holds samples
k*mbs*dp + r*mbs ... +mbs, so each rank reads a disjoint part and the global batch holds the same
rows whatever the number of ranks. The only state is the number of samples consumed, so a resume
on a different dp degree continues exactly where the run stopped; memory is O(1) in the steps run
(one permutation of the rows, of the current epoch).
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100  # a label that is not a target (cross_entropy's ignore_index)


class SampleOrder:
    """Which rows (in [0, n_rows)) this dp rank reads for each optimizer step; resumable."""

    def __init__(self, n_rows: int, micro_batch_size: int, grad_accum: int, dp_rank: int, dp_size: int,
                 seed: int = 0, shuffle: bool = True):
        if n_rows < 1:
            raise ValueError(f"SampleOrder needs at least one row, got {n_rows}")
        self.n_rows, self.mbs, self.accum = n_rows, micro_batch_size, grad_accum
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.samples_seen = 0
        self._perm_epoch, self._perm = -1, None

    @property
    def global_batch(self) -> int:
        return self.mbs * self.accum * self.dp_size

    def row(self, sample: int) -> int:
        """The row global sample `sample` reads: its epoch's permutation at its position."""
        epoch, pos = divmod(sample, self.n_rows)
        if not self.shuffle:
            return pos
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)
            self._perm_epoch = epoch
        return int(self._perm[pos])

    def rows_for_step(self) -> list[list[int]]:
        """This rank's `grad_accum` micro-batches of the next step, `micro_batch_size` rows each; advances."""
        base, mbs = self.samples_seen, self.mbs
        firsts = [base + k * mbs * self.dp_size + self.dp_rank * mbs for k in range(self.accum)]
        out = [[self.row(s) for s in range(first, first + mbs)] for first in firsts]
        self.samples_seen += self.global_batch
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"samples_seen": torch.tensor(self.samples_seen, dtype=torch.int64)}

    def load_state_dict(self, state: dict) -> None:
        """Accepts what `state_dict` returns (a tensor) or a plain int."""
        self.samples_seen = int(state["samples_seen"])


class RowLoader:
    """What the trainer uses of a loader, over a `SampleOrder`; a loader implements `rows(ids)`.

    `next_step()` -> `grad_accum` (inputs, labels) pairs of shape (micro_batch_size, seq_len) for
    this rank; `state_dict()`/`load_state_dict()` (tensors: a `Stateful` for DCP), `samples_seen`,
    `global_batch`, `n_rows` (rows of seq_len in one epoch).
    """

    def __init__(self, order: SampleOrder):
        self.order = order

    def rows(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `ids` as (inputs, labels), each (len(ids), seq_len) int64."""
        raise NotImplementedError

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.rows(ids) for ids in self.order.rows_for_step()]

    @property
    def n_rows(self) -> int:
        return self.order.n_rows

    @property
    def global_batch(self) -> int:
        return self.order.global_batch

    @property
    def samples_seen(self) -> int:
        return self.order.samples_seen

    @samples_seen.setter
    def samples_seen(self, value: int) -> None:
        self.order.samples_seen = int(value)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.order.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state)
