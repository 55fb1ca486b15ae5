"""Document masking for packed rows: each token's position within its document, and labels that
never cross a document boundary.

The token stream is EOS-separated documents (`ids + [EOS]` each), cut into windows of seq_len + 1
tokens: window w is tokens[w*L : w*L + L + 1], inputs its first L tokens, labels its last L (as
`PackedLoader.rows` does). With document masking a row also carries `positions` (0 where a document
starts; a row may start inside a document, which then continues its positions), which the model turns
into RoPE positions and a per-document causal mask (`Transformer.forward(tokens, positions)`). A
label whose target token starts a document is IGNORE_INDEX: the previous document's EOS does not
predict the next document's first token. Predicting a document's own EOS stays a target.

`doc_starts` are the sorted offsets of every document's first token (doc_starts[0] == 0);
`doc_starts_from_eos` derives them from the stream.
"""

from __future__ import annotations

import numpy as np
import torch

from shardlm.data.order import IGNORE_INDEX


def doc_starts_from_eos(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """Offsets of every document's first token in an EOS-terminated stream: 0 and each token after an EOS.

    One pass over the stream (for a memory-mapped corpus, worth caching next to the token file).
    """
    after_eos = np.flatnonzero(np.asarray(tokens) == eos_id) + 1
    return np.concatenate([[0], after_eos[after_eos < len(tokens)]]).astype(np.int64)


def window_positions(doc_starts: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """(hi - lo,) int64: the position of each of tokens lo..hi-1 within its document.

    O(log D + T): two binary searches find the document holding token lo and the starts inside the
    window; each token's document start is then a running maximum. Duplicate starts are harmless.
    """
    if len(doc_starts) == 0 or doc_starts[0] != 0:
        raise ValueError("doc_starts must begin with 0 (the first document starts the stream)")
    if not 0 <= lo <= hi:
        raise ValueError(f"window [{lo}, {hi}) is not a range of the stream")
    first = int(np.searchsorted(doc_starts, lo, side="right")) - 1  # the document holding token lo
    end = int(np.searchsorted(doc_starts, hi, side="left"))
    start_of = np.zeros(hi - lo, dtype=np.int64)
    if hi == lo:
        return start_of
    start_of[0] = doc_starts[first]
    inner = np.asarray(doc_starts[first + 1 : end], dtype=np.int64)  # starts in (lo, hi)
    start_of[inner - lo] = inner
    np.maximum.accumulate(start_of, out=start_of)
    return np.arange(lo, hi, dtype=np.int64) - start_of


def mask_cross_document(labels: torch.Tensor | np.ndarray,
                        target_positions: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """A copy of `labels` with IGNORE_INDEX where the target token starts a document (its position is 0).

    target_positions: the positions of the label tokens themselves (for inputs tokens[lo:lo+L], the
    positions of tokens lo+1 .. lo+L), the same shape as labels.
    """
    if isinstance(labels, torch.Tensor):
        starts = torch.as_tensor(target_positions, device=labels.device) == 0
        return labels.masked_fill(starts, IGNORE_INDEX)
    return np.where(np.asarray(target_positions) == 0, IGNORE_INDEX, np.asarray(labels, dtype=np.int64))


def document_rows(tokens: np.ndarray, doc_starts: np.ndarray, windows: list[int], seq_len: int,
                  cp: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Windows of `seq_len` + 1 tokens as (inputs, labels, positions), each (len(windows), seq_len) int64.

    Window w covers tokens[w*L : w*L + L + 1] (PackedLoader's windows): inputs are its first L tokens,
    labels its last L with cross-document targets IGNORE_INDEX, positions those of the inputs.

    cp = (rank, size), parallel.cp: inputs and labels are slice `rank` of `size` (L / size tokens; only those
    tokens and the one after are read), positions stay the whole row's (they need only `doc_starts`).
    """
    L = seq_len
    rank, size = cp
    t = L // size
    lo = rank * t
    if not windows:
        return (torch.zeros(0, t, dtype=torch.int64), torch.zeros(0, t, dtype=torch.int64),
                torch.zeros(0, L, dtype=torch.int64))
    if (max(windows) + 1) * L + 1 > len(tokens):
        raise ValueError(f"window {max(windows)} needs {(max(windows) + 1) * L + 1} tokens; the stream has "
                         f"{len(tokens)}")
    x = np.stack([np.asarray(tokens[w * L + lo : w * L + lo + t + 1]) for w in windows]).astype(np.int64)
    pos = np.stack([window_positions(doc_starts, w * L, w * L + L + 1) for w in windows])
    labels = mask_cross_document(x[:, 1:], pos[:, lo + 1 : lo + t + 1])
    return torch.from_numpy(x[:, :-1].copy()), torch.from_numpy(labels), torch.from_numpy(pos[:, :-1].copy())
