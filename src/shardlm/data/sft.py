"""Supervised fine-tuning data: SFT samples in a token store -> packed (or padded) rows -> per-dp-rank micro-batches.

Records (chat, prompt/completion, alpaca; from .jsonl(.gz/.zst), parquet, arrow or HF datasets folders) are
rendered and tokenised into (ids, answer mask) samples by `shardlm.data.chat`, offline and in parallel, into a
token store of kind "sft" (`shardlm prepare --data.format sft`, or the data cache when training on the raw
files: `shardlm.data.store`). The store holds each sample's ids, a one-byte answer mask per token, and per
sample the first answer position and the answer-token count; a rank keeps only per-sample lengths and the
packing (about 30 bytes a sample) and reads a row's tokens from the memory map when it is batched.

Labels. A sample of n tokens gives n - 1 (input, label) pairs: inputs = ids[:-1], label[t] = ids[t+1]
where token t+1 is an answer token, else IGNORE_INDEX. A sample's first token is never a target.

Samples longer than seq_len + 1 tokens are cut to seq_len + 1 (the end of the answer is lost; they
are counted in `truncated`); a sample left with no target token is dropped (counted in `dropped`).

Batching. `pack=True`: the (input, label) pairs of whole samples are placed into rows of seq_len by
best-fit decreasing (deterministic; a sample is never split over rows) and the rest of a row is
padding (input = pad id, label = IGNORE_INDEX). Each sample keeps its own labels, so no label ever
predicts another sample's token (a sample's last token, its EOS, is only ever a label: nothing in a row
predicts the next sample's first token). Attention is not blocked between samples of a row unless
`document_mask=True`: then `rows()` also returns positions, restarting at 0 at each sample and at the
padding (one more "document"), and the model attends within each sample only (see
`shardlm.data.packing`). `pack=False`: one sample per row, padded. Rows are then dealt by the same
`SampleOrder` as PackedLoader's windows: step s uses global rows [s*G, (s+1)*G) of a seeded per-epoch
permutation, micro-batch k of dp rank r holds rows k*mbs*dp + r*mbs ... +mbs; the only state is
`samples_seen`, so a resume on any dp degree continues where the run stopped.
"""


from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from shardlm.data.chat import (  # noqa: F401  (re-exported: the SFT names live here for users)
    SHAPES, ChatTemplate, PlainTemplate, answer_info, load_template, record_to_messages, tokenize_records)
from shardlm.data.order import IGNORE_INDEX, RowLoader, SampleOrder
from shardlm.data.store.cache import default_cache_dir
from shardlm.data.store.prepare import ensure_cached_store, sft_spec
from shardlm.errors import DataError


@dataclass
class SFTSamples:
    """SFT samples back to back: sample i is ids[starts[i]:starts[i+1]] with its answer mask over the same span;
    answers[i] = (first answer position >= 1, or 0 when none; answer tokens at positions >= 1). The arrays are
    a token store's memory maps (`from_store`) or, for small inputs and tests, in memory (`from_pairs`)."""

    ids: np.ndarray
    mask: np.ndarray  # uint8 or bool, one per token
    starts: np.ndarray  # samples + 1 offsets
    answers: np.ndarray  # (samples, 2) int64

    @classmethod
    def from_store(cls, store) -> SFTSamples:
        if store.kind != "sft":
            raise DataError(f"token store {store.path} holds text documents, not SFT samples; prepare the SFT "
                            "records with `shardlm prepare ... --data.format sft`")
        return cls(store.tokens, store.mask, store.starts, store.answers)

    @classmethod
    def from_pairs(cls, samples: Sequence[tuple[Sequence[int], Sequence[bool]]]) -> SFTSamples:
        ids, masks, answers = [], [], []
        for a, m in samples:
            a, m = np.asarray(a, dtype=np.int64), np.asarray(m, dtype=bool)
            if len(a) != len(m):
                raise ValueError("token ids and answer mask differ in length")
            ids.append(a)
            masks.append(m)
            answers.append(answer_info(m))
        lengths = [len(a) for a in ids]
        return cls(np.concatenate(ids) if ids else np.zeros(0, np.int64),
                   np.concatenate(masks) if masks else np.zeros(0, bool),
                   np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                   np.asarray(answers, dtype=np.int64).reshape(-1, 2))

    def __len__(self) -> int:
        return len(self.starts) - 1


# -- batching --------------------------------------------------------------------------------------
def pack_rows(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing packing of items with `lengths` into rows of `capacity` -> (ptr, items): row r holds
    items[ptr[r]:ptr[r+1]] in the order they were placed. Deterministic: ties go to the lower index / row.
    O(n log n) for the sort, then O(log capacity) per item: open rows are kept in a heap per free room."""
    lengths = np.asarray(lengths)
    idx = _index_dtype(len(lengths))
    order = np.argsort(-lengths.astype(np.int64), kind="stable").astype(idx)  # longest first, then by index
    rooms: list[int] = []  # sorted free rooms that have an open row
    by_room: dict[int, list[int]] = {}  # room -> heap of rows with that room
    row_of = np.empty(len(lengths), dtype=idx)
    n_rows = 0
    for i, n in _chunked(order, lengths[order]):
        j = bisect_left(rooms, n)
        if j == len(rooms):
            row, room = n_rows, capacity - n
            n_rows += 1
        else:
            old = rooms[j]
            heap = by_room[old]
            row = heapq.heappop(heap)
            if not heap:
                del by_room[old]
                rooms.pop(j)
            room = old - n
        row_of[i] = row
        if room > 0:
            if room not in by_room:
                by_room[room] = []
                insort(rooms, room)
            heapq.heappush(by_room[room], row)
    placed = row_of[order]
    del row_of
    items = order[np.argsort(placed, kind="stable")]
    ptr = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(placed, minlength=n_rows), out=ptr[1:])
    return ptr, items


def _index_dtype(n: int) -> np.dtype:
    return np.dtype(np.int32) if n < 2**31 else np.dtype(np.int64)


def _chunked(*arrays: np.ndarray, size: int = 1 << 16):
    """zip(*arrays) as Python ints, converted a chunk at a time (a whole .tolist() would cost ~36 bytes an item)."""
    for a in range(0, len(arrays[0]), size):
        yield from zip(*(x[a : a + size].tolist() for x in arrays))


class SFTLoader(RowLoader):
    """PackedLoader's interface over SFT samples: rows of (inputs, labels) with answer-only labels.

    `samples`: an `SFTSamples` (a store's memory maps) or (token ids, answer mask) pairs. Samples are
    truncated, filtered and packed (or padded) here from their lengths and answer positions only, and `stats`
    says how: samples kept, truncated, dropped, tokens, loss tokens, rows and the fill of the rows. The tokens
    are read from `samples` when a row is built. `lengths[i]` is kept sample i's number of (input, label) pairs.
    """

    def __init__(self, samples: SFTSamples | Sequence[tuple[Sequence[int], Sequence[bool]]], seq_len: int,
                 micro_batch_size: int, grad_accum: int, dp_rank: int, dp_size: int, seed: int = 0,
                 shuffle: bool = True, pack: bool = True, pad_id: int = 0, document_mask: bool = False):
        L = self.seq_len = seq_len
        self.pack, self.pad_id, self.document_mask = pack, pad_id, document_mask
        self.mark_padding = False  # rows also say which tokens are padding (`rows`)
        data = samples if isinstance(samples, SFTSamples) else SFTSamples.from_pairs(samples)
        self.data = data
        # Per sample, from the index only (the tokens stay in the memory map): held ~24 bytes a sample
        # (kept index, start, length, row slot), ~80 at the peak while packing.
        starts = np.asarray(data.starts, dtype=np.int64)
        n_tok = np.diff(starts)
        first = np.asarray(data.answers[:, 0])
        keep = (n_tok >= 2) & (first >= 1) & (first <= L)
        truncated, dropped = int(np.count_nonzero(n_tok > L + 1)), int(len(keep) - np.count_nonzero(keep))
        self._kept = np.flatnonzero(keep).astype(_index_dtype(len(keep)))
        del keep, first
        if not self._kept.size:
            raise DataError("no SFT sample has an answer token left within data.seq_len"
                            + (f" ({dropped} dropped)" if dropped else "") + "; add data or raise data.seq_len")
        self._start = starts[self._kept]
        kept_tok = n_tok[self._kept]
        del n_tok
        cut = np.flatnonzero(kept_tok > L + 1)
        np.minimum(kept_tok, L + 1, out=kept_tok)
        self.lengths = (kept_tok - 1).astype(np.int32)
        del kept_tok
        loss = int(np.asarray(data.answers[:, 1])[self._kept].sum())
        for k in cut.tolist():  # cut samples: count the answers left (few samples)
            o = int(self._start[k])
            loss += int(np.count_nonzero(data.mask[o + 1 : o + L + 1])) - int(data.answers[self._kept[k], 1])
        if pack:
            self._ptr, self._items = pack_rows(self.lengths, L)
        else:
            self._ptr = np.arange(len(self._kept) + 1, dtype=np.int64)
            self._items = np.arange(len(self._kept), dtype=self._kept.dtype)
        super().__init__(SampleOrder(len(self._ptr) - 1, micro_batch_size, grad_accum, dp_rank, dp_size, seed,
                                     shuffle))
        n_pairs = int(self.lengths.sum(dtype=np.int64))
        self.stats = {"samples": int(self._kept.size), "truncated": truncated, "dropped": dropped,
                      "tokens": n_pairs + int(self._kept.size),  # each sample's n tokens give n - 1 pairs
                      "loss_tokens": loss, "rows": self.n_rows,
                      "fill": round(n_pairs / (self.n_rows * L), 4)}

    def row(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        """Row w as (inputs, labels), each seq_len long; the tail is padding."""
        x = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        y = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        pos = 0
        for i in self.row_samples(w):
            o, n = int(self._start[i]), int(self.lengths[i])
            ids = np.asarray(self.data.ids[o : o + n + 1], dtype=np.int64)
            answer = np.asarray(self.data.mask[o + 1 : o + n + 1], dtype=bool)
            x[pos : pos + n] = ids[:-1]
            y[pos : pos + n] = np.where(answer, ids[1:], IGNORE_INDEX)
            pos += n
        return x, y

    def row_positions(self, w: int) -> np.ndarray:
        """Row w's positions: 0, 1, ... within each sample, then 0, 1, ... over the padding."""
        lengths = [int(self.lengths[i]) for i in self.row_samples(w)]
        pad = self.seq_len - sum(lengths)
        return np.concatenate([np.arange(n, dtype=np.int64) for n in [*lengths, pad]])

    def row_samples(self, w: int) -> list[int]:
        """Indices (among the kept samples, in input order) of the samples in row w, in row order."""
        return self._items[self._ptr[w] : self._ptr[w + 1]].tolist()

    def rows(self, ids: list[int]) -> tuple[torch.Tensor | None, ...]:
        """(inputs, labels), or (inputs, labels, positions) with `document_mask`; each (len(ids), seq_len). With
        `mark_padding` (the trainer sets it for a mixture of experts: the router statistics leave padding out, as
        HF's attention mask does), (inputs, labels, positions or None, real): real is False on the padding."""
        rows = [self.row(w) for w in ids]
        out = (torch.from_numpy(np.stack([r[0] for r in rows])), torch.from_numpy(np.stack([r[1] for r in rows])))
        positions = torch.from_numpy(np.stack([self.row_positions(w) for w in ids])) if self.document_mask else None
        if self.mark_padding:
            filled = torch.tensor([sum(int(self.lengths[i]) for i in self.row_samples(w)) for w in ids])
            return (*out, positions, torch.arange(self.seq_len)[None, :] < filled[:, None])
        return out if positions is None else (*out, positions)


def sft_stats(loader: SFTLoader, store, template: str) -> dict:
    """`loader.stats` with the store's record count and the template's name."""
    return {"records": store.documents, **loader.stats, "template": template}


def build_sft_loader(files: Sequence[Path], tokenizer, tokenizer_dir: str | Path | None, *, seq_len: int,
                     micro_batch_size: int, grad_accum: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                     shuffle: bool = True, pack: bool = True, document_mask: bool = False,
                     max_bad_fraction: float = 0.001, cache_dir: str | Path | None = None,
                     workers: int = 1) -> tuple[SFTLoader, dict]:
    """SFT records in `files` -> a token store of kind "sft" in `cache_dir` (default: the data cache; prepared
    once, reused after) -> (loader, stats). Training takes the same path (`shardlm.data.loader.build_loader`).

    `tokenizer_dir`: the folder whose chat template renders the records (None, or a folder without one: the
    plain template). `document_mask`: rows also carry positions (`SFTLoader.rows`), so the model attends within
    each sample only. stats: records, samples (kept), truncated, dropped (no answer token within seq_len),
    tokens, loss_tokens, rows, fill (non-padding share of the rows), template (`chat_template` or `plain`).
    """
    spec = sft_spec([Path(f) for f in files], tokenizer, tokenizer_dir)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    store = ensure_cached_store(spec, cache, workers=workers, max_bad_fraction=max_bad_fraction, log=lambda _: None)
    if store.documents == 0:
        raise DataError(f"no SFT records found in {', '.join(map(str, files)) or 'data.path'} "
                        f"(each record must be one of {SHAPES})")
    loader = SFTLoader(SFTSamples.from_store(store), seq_len, micro_batch_size, grad_accum, dp_rank, dp_size, seed,
                       shuffle, pack, pad_id=tokenizer.eos_id, document_mask=document_mask)
    return loader, sft_stats(loader, store, store.manifest["template"]["name"])
