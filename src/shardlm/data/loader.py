"""Tokenise once into a cached token file, pack into `seq_len` windows, deal them to data-parallel ranks.

Sample order is global: step s uses samples [s*G, (s+1)*G) of a seeded per-epoch permutation of the
windows, G = micro_batch_size x grad_accum x dp. Within a step, micro-batch k of dp rank r holds
samples k*mbs*dp + r*mbs ... +mbs, so each rank reads a disjoint part and the global batch holds the
same samples whatever the number of ranks. The only state is the number of samples consumed, so a
resume on a different dp degree continues exactly where the run stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from shardlm.data.sources import iter_documents
from shardlm.data.tokenizer import ByteTokenizer, Tokenizer
from shardlm.errors import ConfigError

IGNORE_INDEX = -100
_ENCODE_BATCH = 256


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardlm" / "tokens"


def cache_key(files: list[Path], tokenizer: Tokenizer, text_field: str) -> str:
    h = hashlib.sha256(f"v1|{tokenizer.fingerprint}|{text_field}".encode())
    for f in files:
        st = f.stat()
        h.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def _encode_all(docs, tokenizer: Tokenizer, dtype: np.dtype, out) -> tuple[int, int]:
    """Write each document's ids plus EOS to `out`; returns (documents, tokens)."""
    n_docs = n_tok = 0
    eos = np.array([tokenizer.eos_id], dtype=dtype)

    def flush(batch: list[str]) -> None:
        nonlocal n_docs, n_tok
        if isinstance(tokenizer, ByteTokenizer):
            arrays = [np.frombuffer(d.encode("utf-8"), dtype=np.uint8) for d in batch]
        else:
            arrays = [np.asarray(ids) for ids in tokenizer.encode_batch(batch)]
        for a in arrays:
            out.write(a.astype(dtype).tobytes())
            out.write(eos.tobytes())
            n_tok += a.size + 1
        n_docs += len(batch)

    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == _ENCODE_BATCH:
            flush(batch)
            batch = []
    if batch:
        flush(batch)
    return n_docs, n_tok


def build_token_file(files: list[Path], tokenizer: Tokenizer, text_field: str, cache_dir: Path) -> Path:
    """Tokenise `files` into `<cache_dir>/<key>.bin` (written under a temporary name, then renamed)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = cache_key(files, tokenizer, text_field)
    path = cache_dir / f"{key}.bin"
    if path.exists():
        return path
    dtype = _token_dtype(tokenizer.vocab_size)
    tmp = cache_dir / f".{key}.{os.getpid()}.tmp"
    with open(tmp, "wb") as out:
        n_docs, n_tok = _encode_all(iter_documents(files, text_field), tokenizer, dtype, out)
    (cache_dir / f"{key}.json").write_text(json.dumps({"dtype": dtype.name, "documents": n_docs, "tokens": n_tok}))
    os.replace(tmp, path)
    return path


def open_token_file(path: Path) -> tuple[np.ndarray, dict]:
    meta = json.loads(path.with_suffix(".json").read_text())
    if meta["tokens"] == 0:
        return np.zeros(0, dtype=meta["dtype"]), meta
    return np.memmap(path, dtype=meta["dtype"], mode="r"), meta


class GlobalSampleOrder:
    """The sample order shared by every loader: step s takes global samples [s*G, (s+1)*G) of a seeded
    per-epoch permutation; micro-batch k of dp rank r holds samples k*mbs*dp + r*mbs ... +mbs.
    Subclasses set mbs, accum, dp_rank, dp_size, seed, shuffle, n_windows and `_batch(first_sample)`."""

    samples_seen = 0
    _perm_epoch, _perm = -1, None

    @property
    def global_batch(self) -> int:
        return self.mbs * self.accum * self.dp_size

    def _window(self, sample: int) -> int:
        epoch, pos = divmod(sample, self.n_windows)
        if not self.shuffle:
            return pos
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return int(self._perm[pos])

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`grad_accum` (inputs, labels) pairs of shape (micro_batch_size, seq_len) for this rank."""
        base = self.samples_seen
        out = [self._batch(base + k * self.mbs * self.dp_size + self.dp_rank * self.mbs) for k in range(self.accum)]
        self.samples_seen += self.global_batch
        return out

    def state_dict(self) -> dict:
        return {"samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict) -> None:
        self.samples_seen = int(state["samples_seen"])


class PackedLoader(GlobalSampleOrder):
    """Yields this rank's micro-batches for each optimizer step; `state_dict()` makes it resumable."""

    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch_size: int, grad_accum: int,
                 dp_rank: int, dp_size: int, seed: int = 0, shuffle: bool = True):
        self.tokens, self.seq_len = tokens, seq_len
        self.n_windows = (len(tokens) - 1) // seq_len if len(tokens) > 0 else 0
        if self.n_windows < 1:
            raise ConfigError(f"the corpus has {len(tokens)} tokens, fewer than data.seq_len + 1 = {seq_len + 1}; "
                              "add text or lower data.seq_len")
        self.mbs, self.accum, self.dp_rank, self.dp_size = micro_batch_size, grad_accum, dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.samples_seen = 0
        self._perm_epoch, self._perm = -1, None

    def _batch(self, first_sample: int) -> tuple[torch.Tensor, torch.Tensor]:
        L = self.seq_len
        rows = [self.tokens[w * L : w * L + L + 1] for w in map(self._window, range(first_sample, first_sample + self.mbs))]
        x = torch.from_numpy(np.stack(rows).astype(np.int64))
        return x[:, :-1], x[:, 1:]


def build_loader(files: list[Path], tokenizer: Tokenizer, text_field: str, cache_dir: Path, *, seq_len: int,
                 micro_batch_size: int, grad_accum: int, dp_rank: int, dp_size: int, seed: int, shuffle: bool,
                 is_builder: bool, barrier: Callable[[], None]) -> tuple[PackedLoader, dict]:
    """One rank per machine tokenises (or finds the cache); the others wait, then all memory-map it."""
    path = cache_dir / f"{cache_key(files, tokenizer, text_field)}.bin"
    if is_builder:
        build_token_file(files, tokenizer, text_field, cache_dir)
    barrier()
    tokens, meta = open_token_file(path)
    if meta["tokens"] == 0:
        raise ConfigError("the corpus is empty: no non-empty documents found in data.path")
    loader = PackedLoader(tokens, seq_len, micro_batch_size, grad_accum, dp_rank, dp_size, seed, shuffle)
    return loader, meta
