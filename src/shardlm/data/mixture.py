"""A mixture of several packed corpora, interleaved at the sample level, with `SampleOrder`'s dealing contract.

Each source i has `n_rows[i]` rows (all seq_len tokens, so samples == tokens), a weight (the fraction of
training samples it gets; normalised) and an optional epochs cap (floor(epochs * n_rows) samples; None =
unlimited). Global sample t goes to the source minimising (consumed_i - base_i + 0.5) / w_i among those
not exhausted, ties to the lowest index: smooth weighted round robin (Sainte-Lague), so after any number
of samples each source is within about one sample of its share. `consumed_i` is how many samples source
i gave; `base_i` is its count when the current weights took effect (0, or the resume step at which the
weights or caps changed). The interleaving depends on the weights only, not on the seed; the seed picks
the rows: source i's k-th sample reads row Permutation(n_rows_i, derive_seed(seed, i), k // n_rows_i)
at k % n_rows_i (`shardlm.data.order.Permutation`), so each epoch of a source is a permutation of its rows.

Every rank computes the whole global batch's assignment (O(G x sources)) from the state and takes its own
slice (micro-batch k of rank r: samples k*mbs*dp + r*mbs ... +mbs), so all ranks agree, the global batch
does not depend on the dp degree and a resume on another dp degree is exact.
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction

import numpy as np
import torch

from shardlm.data.order import ORDER_VERSION, Permutation, check_order_version, derive_seed, permuted_rows, \
    rank_positions
from shardlm.errors import ConfigError, DataError


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _cap(epochs: float | None, n_rows: int) -> int | None:
    """floor(epochs * n_rows), exact for decimal epochs (1.15 x 100 is 115, not 114.99...)."""
    return None if epochs is None else math.floor(Fraction(repr(float(epochs))) * n_rows)


class MixtureOrder:
    """Which (source, row) pairs this dp rank reads for each optimizer step; resumable; see the module doc."""

    ORDER_VERSION = ORDER_VERSION

    def __init__(self, n_rows: list[int], weights: list[float], micro_batch_size: int, grad_accum: int,
                 dp_rank: int, dp_size: int, seed: int = 0, shuffle: bool = True,
                 epochs: list[float | None] | None = None, names: list[str] | None = None):
        n_src = len(n_rows)
        self.names = list(names) if names is not None else [f"source{i}" for i in range(n_src)]
        epochs = list(epochs) if epochs is not None else [None] * n_src
        for what, seq in (("weights", weights), ("epochs", epochs), ("names", self.names)):
            if len(seq) != n_src:
                raise ConfigError(f"data mixture: {len(seq)} {what} for {n_src} sources; give one per source")
        if n_src == 0:
            raise ConfigError("data mixture: no sources; give at least one")
        for name, n, w, e in zip(self.names, n_rows, weights, epochs):
            if int(n) < 1:
                raise DataError(f"data mixture: source {name} has {n} rows; it needs at least one")
            if not (_real(w) and math.isfinite(w) and w > 0):
                raise ConfigError(f"data mixture: source {name} has weight {w!r}; weights must be finite and > 0")
            if e is not None and not (_real(e) and math.isfinite(e) and e > 0):
                raise ConfigError(f"data mixture: source {name} has epochs {e!r}; give a number > 0 or None "
                                  "(unlimited)")
        self.n_rows = [int(n) for n in n_rows]
        total = math.fsum(weights)
        self.weights = [w / total for w in weights]
        self.epochs = epochs
        self.caps = [_cap(e, n) for e, n in zip(epochs, self.n_rows)]
        self.mbs, self.accum, self.dp_rank, self.dp_size = micro_batch_size, grad_accum, dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.seeds = [derive_seed(seed, i) for i in range(n_src)]
        self.consumed = [0] * n_src
        self.base = [0] * n_src
        self._offsets = rank_positions(micro_batch_size, grad_accum, dp_rank, dp_size)
        self._perms: list[dict[int, Permutation]] = [{} for _ in range(n_src)]

    @property
    def global_batch(self) -> int:
        return self.mbs * self.accum * self.dp_size

    @property
    def samples_seen(self) -> int:
        """Samples consumed by the whole run, all sources together."""
        return sum(self.consumed)

    def exhausted(self) -> list[str]:
        """Names of the sources whose epochs cap is reached (they take no more samples)."""
        return [name for name, c, cap in zip(self.names, self.consumed, self.caps) if cap is not None and c >= cap]

    def max_samples(self) -> int | None:
        """Samples the run can draw before every source is exhausted; None when a source is unlimited."""
        return None if any(cap is None for cap in self.caps) else sum(self.caps)

    def check_feeds(self, steps: int, global_batch: int) -> None:
        """A mixture whose epoch caps cannot feed `steps` optimizer steps fails at the start, not mid-run."""
        cap, need = self.max_samples(), steps * global_batch
        if cap is not None and need > cap:
            raise DataError(f"data.sources: the epochs caps allow {cap:,} samples, train.steps={steps} needs "
                            f"{need:,}; raise the caps or lower train.steps")

    def assign(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The sources and per-source sample indices of the next `count` global samples (does not advance).

        The greedy choice (min (consumed_i - base_i + 0.5) / w_i, ties to the lowest i) equals the merge of
        each source's increasing sequence of those values, so it is computed as one sort."""
        values, srcs, ks = [], [], []
        for i, (c, b, w, cap) in enumerate(zip(self.consumed, self.base, self.weights, self.caps)):
            take = count if cap is None else max(0, min(count, cap - c))
            j = np.arange(take, dtype=np.int64)
            values.append(((c - b + j).astype(np.float64) + 0.5) / w)
            srcs.append(np.full(take, i, dtype=np.int64))
            ks.append(c + j)
        src, k = np.concatenate(srcs), np.concatenate(ks)
        if len(src) < count:
            capped = ", ".join(f"{n} (epochs {e:g})" for n, e in zip(self.names, self.epochs) if e is not None)
            raise DataError(f"the data mixture is exhausted after {self.samples_seen} samples: {capped} reached "
                            f"their epochs caps ({len(src)} samples left, a step needs {count}); raise the epochs "
                            "caps or lower train.steps")
        pick = np.lexsort((src, np.concatenate(values)))[:count]
        return src[pick], k[pick]

    def rows_of(self, src: np.ndarray, k: np.ndarray) -> np.ndarray:
        """The row each (source, k-th sample of that source) reads: its epoch's permutation of the source."""
        rows = np.empty_like(k)
        for i in np.unique(src).tolist():
            sel = src == i
            rows[sel] = permuted_rows(k[sel], self.n_rows[i], self.seeds[i], self.shuffle, self._perms[i])
        return rows

    def rows_for_step(self) -> list[list[tuple[int, int]]]:
        """This rank's `grad_accum` micro-batches of the next step, `micro_batch_size` (source, row) each;
        advances. `DataError` (and no advance) if the sources cannot fill the step."""
        src, k = self.assign(self.global_batch)
        mine_src, mine_k = src[self._offsets], k[self._offsets]
        rows = self.rows_of(mine_src.ravel(), mine_k.ravel()).reshape(mine_k.shape)
        for i, c in enumerate(np.bincount(src, minlength=len(self.n_rows)).tolist()):
            self.consumed[i] += c
        return [list(zip(s, r)) for s, r in zip(mine_src.tolist(), rows.tolist())]

    def shares(self) -> list[float]:
        """The realised fraction of samples per source so far (zeros before the first sample)."""
        total = self.samples_seen
        return [c / total for c in self.consumed] if total else [0.0] * len(self.consumed)

    def describe(self) -> str:
        """One line for the log: per source its target weight, realised share and epochs done; the exhausted."""
        parts = []
        for name, w, s, c, n, e in zip(self.names, self.weights, self.shares(), self.consumed, self.n_rows,
                                       self.epochs):
            cap = "" if e is None else f" of {e:g}"
            parts.append(f"{name} weight {w:.3f} share {s:.3f} epochs {c / n:.2f}{cap}")
        gone = self.exhausted()
        return (f"data mix after {self.samples_seen} samples: " + "; ".join(parts)
                + (f"; exhausted: {', '.join(gone)}" if gone else ""))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """samples_seen, consumed and base per source, the weights and caps (-1: none) they applied under."""
        return {"samples_seen": torch.tensor(self.samples_seen, dtype=torch.int64),
                "consumed": torch.tensor(self.consumed, dtype=torch.int64),
                "base": torch.tensor(self.base, dtype=torch.int64),
                "weights": torch.tensor(self.weights, dtype=torch.float64),
                "caps": torch.tensor([-1 if c is None else c for c in self.caps], dtype=torch.int64),
                "order_version": torch.tensor(ORDER_VERSION, dtype=torch.int64)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`: consumed samples are not repeated; if the weights or caps differ from the
        checkpoint's, the current ones apply from here on (their counts restart at this step)."""
        check_order_version(state)
        if "consumed" not in state:
            if int(state.get("samples_seen", 0)) == 0:
                return
            raise DataError("the checkpoint's data state has no per-source counts (it was written by a single-source "
                            "run); start fresh (checkpoint.resume=none) or train on the data it was written with")
        consumed = [int(c) for c in torch.as_tensor(state["consumed"]).reshape(-1).tolist()]
        if len(consumed) != len(self.n_rows):
            raise DataError(f"the checkpoint's data mixture has {len(consumed)} sources, this run "
                            f"{len(self.n_rows)}; resume with the same sources or start fresh "
                            "(checkpoint.resume=none)")
        if "samples_seen" in state and int(state["samples_seen"]) != sum(consumed):
            raise DataError(f"the checkpoint's data state is inconsistent: samples_seen {int(state['samples_seen'])} "
                            f"!= {sum(consumed)} consumed over the sources")
        self.consumed = consumed
        base = torch.as_tensor(state["base"]).reshape(-1).tolist() if "base" in state else [0] * len(consumed)
        weights = torch.as_tensor(state["weights"], dtype=torch.float64).tolist() if "weights" in state else None
        caps = [None if c < 0 else c for c in torch.as_tensor(state["caps"]).tolist()] if "caps" in state else None
        same = weights is not None and np.allclose(weights, self.weights, rtol=1e-12, atol=0) and caps == self.caps
        self.base = [int(b) for b in base] if same else list(consumed)
