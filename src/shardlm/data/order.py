"""The global sample order every loader shares, and the loader interface the trainer uses.

Step s uses global samples [s*G, (s+1)*G) of a seeded per-epoch permutation of the rows,
G = micro_batch_size x grad_accum x dp. Within a step, micro-batch k of dp rank r holds samples
k*mbs*dp + r*mbs ... +mbs, so each rank reads a disjoint part and the global batch holds the same
rows whatever the number of ranks. The only state is the number of samples consumed, so a resume
on a different dp degree continues exactly where the run stopped.

The permutation (`Permutation`) is a keyed Feistel network computed per index: O(1) memory and time
whatever the number of rows (a materialised permutation of 10^9 windows would be 8 GB per rank).
Its output is part of the checkpoint contract: changing it changes which samples a resume reads,
so any change to `Permutation` must bump `ORDER_VERSION` (tests/unit/data/test_order.py pins its values).
"""

from __future__ import annotations

import numpy as np
import torch

from shardlm.errors import DataError

IGNORE_INDEX = -100  # a label that is not a target (cross_entropy's ignore_index)
ORDER_VERSION = 2  # 1: numpy's permutation per epoch (shardlm before the Feistel order); 2: `Permutation`

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / phi, splitmix64's increment
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finaliser multipliers


def mix64(z: int) -> int:
    """splitmix64's finaliser: a bijective, well-avalanched hash of a 64-bit integer."""
    z &= _M64
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return z ^ (z >> 31)


def _mix64_array(z: np.ndarray) -> np.ndarray:
    """`mix64` on a uint64 array (numpy's uint64 arithmetic wraps modulo 2^64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_C1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_C2)
    return z ^ (z >> np.uint64(31))


def derive_seed(*parts: int) -> int:
    """A 64-bit seed from integers (seed, epoch, source index, ...): deterministic in every process."""
    h = mix64(0x5EED)
    for p in parts:
        h = mix64(h ^ mix64((int(p) & _M64) + _GOLDEN))
    return h


class Permutation:
    """A seeded bijection of [0, n), one per (seed, epoch), computed per index in O(1) memory and time.

    A balanced Feistel network (`ROUNDS` rounds, round function `mix64(half + round key)`) permutes the
    smallest domain [0, 4^k) >= n; an index that lands outside [0, n) is encrypted again (cycle-walking)
    until it lands inside, which keeps the map a bijection of [0, n). The domain is < 4n, so that takes
    under 4 rounds of the network on average.
    """

    ROUNDS = 6

    def __init__(self, n: int, seed: int = 0, epoch: int = 0):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n, self.seed, self.epoch = int(n), int(seed), int(epoch)
        self.half_bits = max(1, ((self.n - 1).bit_length() + 1) // 2)
        self.mask = (1 << self.half_bits) - 1
        base = derive_seed(seed, epoch)
        self.keys = [mix64(base + (r + 1) * _GOLDEN) for r in range(self.ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right, mask = x >> self.half_bits, x & self.mask, self.mask
        for key in self.keys:
            left, right = right, left ^ (mix64(right + key) & mask)
        return (left << self.half_bits) | right

    def __call__(self, i: int) -> int:
        """The position of index i in the permutation."""
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} outside [0, {self.n})")
        x = self._encrypt(int(i))
        while x >= self.n:
            x = self._encrypt(x)
        return x

    def _encrypt_array(self, x: np.ndarray) -> np.ndarray:
        hb, mask = np.uint64(self.half_bits), np.uint64(self.mask)
        left, right = x >> hb, x & mask
        for key in self.keys:
            left, right = right, left ^ (_mix64_array(right + np.uint64(key)) & mask)
        return (left << hb) | right

    def permute(self, indices: np.ndarray) -> np.ndarray:
        """`self(i)` for every i of an integer array, as one array op (int64, same shape)."""
        idx = np.asarray(indices)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError(f"indices outside [0, {self.n})")
        out = self._encrypt_array(idx.astype(np.uint64).ravel())
        pending = np.flatnonzero(out >= np.uint64(self.n))
        while pending.size:  # cycle-walking, over the elements still out of range only
            out[pending] = self._encrypt_array(out[pending])
            pending = pending[out[pending] >= np.uint64(self.n)]
        return out.astype(np.int64).reshape(idx.shape)


def check_order_version(state: dict) -> None:
    """Refuse a loader state whose sample order this shardlm does not compute (resume would repeat or skip
    samples). A state without `order_version` is version 1 unless nothing was consumed yet."""
    if "order_version" not in state:
        if int(state.get("samples_seen", 0)) == 0:
            return
        version = 1
    else:
        version = int(state["order_version"])
    if version == ORDER_VERSION:
        return
    if version < ORDER_VERSION:
        raise DataError(f"the checkpoint's sample order is from an older shardlm (version {version}): its resume "
                        "would repeat or skip samples; start fresh (checkpoint.resume=none) or use the shardlm "
                        "that wrote it")
    raise DataError(f"the checkpoint's sample order is from a newer shardlm (version {version}, this one reads "
                    f"{ORDER_VERSION}); use the shardlm that wrote it or start fresh (checkpoint.resume=none)")


def rank_positions(micro_batch_size: int, grad_accum: int, dp_rank: int, dp_size: int) -> np.ndarray:
    """(grad_accum, micro_batch_size) offsets, within a step's global batch, of this rank's samples."""
    k = np.arange(grad_accum)[:, None] * (micro_batch_size * dp_size)
    return k + dp_rank * micro_batch_size + np.arange(micro_batch_size)[None, :]


def permuted_rows(samples: np.ndarray, n_rows: int, seed: int, shuffle: bool,
                  cache: dict[int, Permutation] | None = None) -> np.ndarray:
    """The rows samples (of a source with `n_rows` rows, epoch-major) read: each epoch's permutation."""
    epochs, pos = np.divmod(samples, n_rows)
    if not shuffle:
        return pos
    out = np.empty_like(pos)
    for epoch in np.unique(epochs).tolist():
        sel = epochs == epoch
        perm = cache.get(epoch) if cache is not None else None
        if perm is None:
            perm = Permutation(n_rows, seed, epoch)
            if cache is not None:
                cache.clear()  # the current epoch (and the next, at a boundary) is all a run needs
                cache[epoch] = perm
        out[sel] = perm.permute(pos[sel])
    return out


class SampleOrder:
    """Which rows (in [0, n_rows)) this dp rank reads for each optimizer step; resumable."""

    ORDER_VERSION = ORDER_VERSION

    def __init__(self, n_rows: int, micro_batch_size: int, grad_accum: int, dp_rank: int, dp_size: int,
                 seed: int = 0, shuffle: bool = True):
        if n_rows < 1:
            raise ValueError(f"SampleOrder needs at least one row, got {n_rows}")
        self.n_rows, self.mbs, self.accum = n_rows, micro_batch_size, grad_accum
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.samples_seen = 0
        self._perms: dict[int, Permutation] = {}
        self._offsets = rank_positions(micro_batch_size, grad_accum, dp_rank, dp_size)

    @property
    def global_batch(self) -> int:
        return self.mbs * self.accum * self.dp_size

    def row(self, sample: int) -> int:
        """The row global sample `sample` reads: its epoch's permutation at its position."""
        epoch, pos = divmod(sample, self.n_rows)
        if not self.shuffle:
            return pos
        perm = self._perms.get(epoch)
        if perm is None:
            self._perms = {epoch: Permutation(self.n_rows, self.seed, epoch)}
            perm = self._perms[epoch]
        return perm(pos)

    def rows_for_step(self) -> list[list[int]]:
        """This rank's `grad_accum` micro-batches of the next step, `micro_batch_size` rows each; advances."""
        samples = self.samples_seen + self._offsets
        rows = permuted_rows(samples, self.n_rows, self.seed, self.shuffle, self._perms)
        self.samples_seen += self.global_batch
        return rows.tolist()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"samples_seen": torch.tensor(self.samples_seen, dtype=torch.int64),
                "order_version": torch.tensor(ORDER_VERSION, dtype=torch.int64)}

    def load_state_dict(self, state: dict) -> None:
        """Accepts what `state_dict` returns (tensors) or plain ints; `DataError` if its order is another version."""
        check_order_version(state)
        if "consumed" in state:
            raise DataError("the checkpoint's data state is a mixture's (data.sources); this run reads one data.path: "
                            "resume with the same data.sources or start fresh (checkpoint.resume=none)")
        self.samples_seen = int(state["samples_seen"])


def check_ids(inputs: torch.Tensor, labels: torch.Tensor, vocab_size: int, source: str, samples_seen: int) -> None:
    """DataError when a token id is outside the vocabulary (labels may also be IGNORE_INDEX, -100): damaged store
    bytes would otherwise index past the embedding (an IndexError on a CPU, a device-side assert that kills a
    GPU job with no message). Two reductions over a micro-batch on the host."""
    lo, hi = int(inputs.min()), int(inputs.max())
    targets = labels[labels != -100]
    if targets.numel():
        lo, hi = min(lo, int(targets.min())), max(hi, int(targets.max()))
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise DataError(f"token id {bad} in the batch after sample {samples_seen:,} of {source} is outside the model's "
                        f"vocabulary (0..{vocab_size - 1}): the store's bytes are damaged or it was prepared for "
                        "another tokenizer; check it with `shardlm prepare --verify DIR` (or data.verify=true) and "
                        "prepare it again")


def context_slice(batch: tuple[torch.Tensor, ...], rank: int, size: int) -> tuple[torch.Tensor, ...]:
    """A micro-batch (inputs, labels[, positions[, real]]) as CP rank `rank` of `size` takes it: inputs, labels
    and the non-padding mask `real` are its contiguous `seq_len / size` tokens of each row (labels were shifted
    before the cut: the slice's last label is the next slice's first input), positions stay whole rows (RoPE and
    the document mask of attention span the whole sequence). size 1: the batch itself."""
    if size == 1:
        return batch
    t = batch[0].shape[1] // size
    cut = slice(rank * t, (rank + 1) * t)
    return tuple(b if i == 2 or b is None else b[:, cut] for i, b in enumerate(batch))


class RowLoader:
    """What the trainer uses of a loader, over a `SampleOrder`; a loader implements `rows(ids)`.

    `next_step()` -> `grad_accum` (inputs, labels) pairs of shape (micro_batch_size, seq_len) for
    this rank (seq_len / parallel.cp under context parallelism: `local_rows`); `state_dict()`/`load_state_dict()` (tensors: a `Stateful` for DCP), `samples_seen`,
    `global_batch`, `n_rows` (rows of seq_len in one epoch).
    """

    vocab_size: int = 0  # when set: every micro-batch's ids are checked against it (`check_ids`)
    source: str = "the token store"  # named in that check's error
    cp_rank, cp_size = 0, 1  # parallel.cp: this rank's slice of every row (`set_context_parallel`)

    def __init__(self, order: SampleOrder):
        self.order = order

    def rows(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `ids` as (inputs, labels), each (len(ids), seq_len) int64."""
        raise NotImplementedError

    def set_context_parallel(self, rank: int, size: int) -> None:
        """Read only slice `rank` of `size` of every row from now on (parallel.cp; see `local_rows`)."""
        self.cp_rank, self.cp_size = rank, size

    def local_rows(self, ids: list[int]) -> tuple[torch.Tensor, ...]:
        """Rows `ids` as this rank of its CP group takes them: see `context_slice`. Loaders that can read only
        the slice override this; the default cuts it out of whole rows (SFT records are tokenised whole)."""
        return context_slice(self.rows(ids), self.cp_rank, self.cp_size)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batches = [self.local_rows(ids) for ids in self.order.rows_for_step()]
        if self.vocab_size:
            for b in batches:
                check_ids(b[0], b[1], self.vocab_size, self.source, self.samples_seen)
        return batches

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
