"""parallel.cp on the data side: each rank of a CP group reads only its contiguous slice of every row.

The CP equivalence runs (tests/distributed/test_context_parallel.py) show the losses are right; this shows the
reads are what the docs say: a token store's windows are read slice by slice (a recording token array sees
nothing outside [w*L + r*L/cp, w*L + (r+1)*L/cp + 1)), the slices of the ranks put back together are the whole
rows, labels shifted across slice boundaries, document-mask labels the same as the whole row's, positions whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardlm.data.loader import MixtureLoader, PackedLoader
from shardlm.data.mixture import MixtureOrder
from shardlm.data.order import IGNORE_INDEX, context_slice
from shardlm.data.packing import doc_starts_from_eos
from shardlm.data.sft import SFTLoader

L, EOS = 32, 0


class Recording:
    """A token array that records every [start, stop) it is sliced with."""

    def __init__(self, tokens: np.ndarray):
        self.tokens, self.reads = tokens, []

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, s):
        assert isinstance(s, slice) and s.step is None, s
        self.reads.append((s.start, s.stop))
        return self.tokens[s]


def _stream(n: int = 20 * L + 1) -> np.ndarray:
    rng = np.random.default_rng(0)
    t = rng.integers(1, 50, size=n)
    t[rng.random(n) < 0.08] = EOS  # documents of ~12 tokens: boundaries inside every slice
    return t.astype(np.int32)


@pytest.mark.parametrize("doc_mask", [False, True], ids=["plain", "documents"])
@pytest.mark.parametrize("cp", [2, 4])
def test_each_rank_reads_only_its_slice_and_the_slices_make_the_rows(cp, doc_mask):
    tokens = _stream()
    starts = doc_starts_from_eos(tokens, EOS) if doc_mask else None
    ids = [3, 0, 11]
    whole = PackedLoader(tokens, L, 3, 1, 0, 1, shuffle=False, doc_starts=starts).rows(ids)
    t = L // cp
    pieces = []
    for r in range(cp):
        rec = Recording(tokens)
        loader = PackedLoader(rec, L, 3, 1, 0, 1, shuffle=False, doc_starts=starts)
        loader.set_context_parallel(r, cp)
        got = loader.local_rows(ids)
        for (a, b), w in zip(rec.reads, ids):
            assert (a, b) == (w * L + r * t, w * L + (r + 1) * t + 1), (r, a, b)  # its slice and one label
        assert len(rec.reads) == len(ids)
        assert got[0].shape == got[1].shape == (3, t)
        for a, b in zip(got, context_slice(whole, r, cp)):
            assert torch.equal(a, b)
        if doc_mask:
            assert torch.equal(got[2], whole[2]) and got[2].shape == (3, L)  # positions: whole rows
        pieces.append(got)
    assert torch.equal(torch.cat([p[0] for p in pieces], 1), whole[0])
    assert torch.equal(torch.cat([p[1] for p in pieces], 1), whole[1])
    # the last label of slice r is the first input of slice r + 1 (no exchange needed at the boundary)
    for r in range(cp - 1):
        nxt = pieces[r + 1][0][:, 0]
        last = pieces[r][1][:, -1]
        assert torch.equal(torch.where(last == IGNORE_INDEX, nxt, last), nxt)
    if doc_mask:
        assert (whole[1] == IGNORE_INDEX).any()  # the stream really has boundaries inside the rows


def test_next_step_is_sliced_for_mixtures_and_sft():
    tokens = _stream()

    def mixture():
        a, b = (PackedLoader(tokens, L, 2, 1, 0, 1, shuffle=False) for _ in range(2))
        return MixtureLoader([a, b], MixtureOrder([a.n_rows, b.n_rows], [0.5, 0.5], 2, 2, 0, 1, shuffle=False))

    whole, mix = mixture().next_step(), mixture()
    mix.set_context_parallel(1, 2)
    assert [(s.cp_rank, s.cp_size) for s in mix.sources] == [(1, 2)] * 2  # the sources read their slices too
    for got, ref in zip(mix.next_step(), whole, strict=True):
        assert got[0].shape == (2, L // 2)
        for x, y in zip(got, context_slice(ref, 1, 2), strict=True):
            assert torch.equal(x, y)

    pairs = [(list(range(1, 20 + i)), [False] * 5 + [True] * (14 + i)) for i in range(8)]

    def sft():
        return SFTLoader(pairs, L, 2, 1, 0, 1, shuffle=False, document_mask=True)

    (whole,), loader = sft().next_step(), sft()
    loader.set_context_parallel(0, 4)
    (got,) = loader.next_step()
    assert got[0].shape == (2, L // 4) and got[2].shape == (2, L)
    for x, y in zip(got, context_slice(whole, 0, 4), strict=True):
        assert torch.equal(x, y)
    # with the padding marked (a mixture of experts): the mask is sliced like the tokens, positions stay whole
    marked, loader = sft(), sft()
    marked.mark_padding = loader.mark_padding = True
    (whole,) = marked.next_step()
    loader.set_context_parallel(3, 4)
    (got,) = loader.next_step()
    assert len(got) == 4 and got[3].shape == (2, L // 4) and got[2].shape == (2, L)
    assert torch.equal(got[3], whole[3][:, 3 * L // 4 :]) and not got[3].all()  # the last quarter holds padding
