"""Tokenise once into a cached token file, pack into `seq_len` windows, deal them to data-parallel ranks;
and `build_loader`, the one entry point that builds the loader `data.format` names.

The windows are dealt in the global sample order of `shardlm.data.order.SampleOrder` (the same for
the SFT loader): the global batch holds the same samples whatever the number of ranks, and the only
state is the number of samples consumed, so a resume on a different dp degree continues exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from shardlm.data.order import IGNORE_INDEX, RowLoader, SampleOrder
from shardlm.data.sft import build_sft_loader
from shardlm.data.sources import iter_documents, resolve_files
from shardlm.data.tokenizer import Tokenizer, encode_texts
from shardlm.errors import DataError

__all__ = ["IGNORE_INDEX", "PackedLoader", "build_loader", "build_packed_loader", "data_stats", "default_cache_dir"]


_TEMPLATE_WORDS = {"chat_template": "the tokenizer's chat template", "plain": "plain ### User/### Assistant template"}


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
    eos = np.array([tokenizer.eos_id], dtype=dtype).tobytes()
    for ids in encode_texts(tokenizer, docs):
        out.write(ids.astype(dtype).tobytes())
        out.write(eos)
        n_tok += ids.size + 1
        n_docs += 1
    return n_docs, n_tok


def build_token_file(files: list[Path], tokenizer: Tokenizer, text_field: str, cache_dir: Path) -> Path:
    """Tokenise `files` into `<cache_dir>/<key>.bin`: written as `.<key>.<host>.<pid>.tmp`, then renamed
    (a failure removes it; what a crash leaves, the next build removes: `remove_partial_files`)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    if removed := remove_partial_files(cache_dir):
        what = "1 partial tokenisation file left by a crashed run" if removed == 1 else \
            f"{removed} partial tokenisation files left by crashed runs"
        print(f"shardlm: data cache: removed {what} in {cache_dir}", file=sys.stderr, flush=True)
    key = cache_key(files, tokenizer, text_field)
    path = cache_dir / f"{key}.bin"
    if path.exists():
        return path
    dtype = _token_dtype(tokenizer.vocab_size)
    tmp = cache_dir / f".{key}.{_writer_host()}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as out:
            n_docs, n_tok = _encode_all(iter_documents(files, text_field), tokenizer, dtype, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    (cache_dir / f"{key}.json").write_text(json.dumps({"dtype": dtype.name, "documents": n_docs, "tokens": n_tok}))
    os.replace(tmp, path)
    return path


PARTIAL_STALE_S = 24 * 3600  # a partial file from another host untouched this long is a crash's
_PARTIAL = re.compile(r"\.[0-9a-f]+\.(?:(?P<host>.+)\.)?(?P<pid>\d+)\.tmp")


def _writer_host() -> str:
    """This machine in partial-file names: the hostname, plus the pid namespace where Linux tells it
    (containers with host networking share a hostname, not their pids)."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())
    try:
        return f"{host}-pidns{re.sub(r'[^0-9]', '', os.readlink('/proc/self/ns/pid'))}"
    except OSError:
        return host


def remove_partial_files(cache_dir: Path) -> int:
    """Remove the partial token files that crashed builds left in `cache_dir`; returns how many.

    One from this host goes when its pid is dead; one from another host (or without a host in its
    name) when it has not been written to for PARTIAL_STALE_S. A live writer's file stays: on this
    host its pid is alive, elsewhere it keeps changing as it is written."""
    now, here, removed = time.time(), _writer_host(), 0
    for f in cache_dir.glob(".*.tmp"):
        m = _PARTIAL.fullmatch(f.name)
        if m is None:
            continue
        try:
            if m["host"] == here:
                stale = not _pid_alive(int(m["pid"]))
            else:
                stale = now - f.stat().st_mtime > PARTIAL_STALE_S
            if stale:
                f.unlink()
                removed += 1
        except FileNotFoundError:  # another machine's build removed it first
            continue
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def open_token_file(path: Path) -> tuple[np.ndarray, dict]:
    meta = json.loads(path.with_suffix(".json").read_text())
    if meta["tokens"] == 0:
        return np.zeros(0, dtype=meta["dtype"]), meta
    return np.memmap(path, dtype=meta["dtype"], mode="r"), meta


class PackedLoader(RowLoader):
    """This rank's micro-batches of `seq_len` windows of the token stream, in the global sample order."""

    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch_size: int, grad_accum: int,
                 dp_rank: int, dp_size: int, seed: int = 0, shuffle: bool = True):
        self.tokens, self.seq_len = tokens, seq_len
        n_windows = (len(tokens) - 1) // seq_len if len(tokens) > 0 else 0
        if n_windows < 1:
            raise DataError(f"the corpus has {len(tokens)} tokens, fewer than data.seq_len + 1 = {seq_len + 1}; "
                            "add text or lower data.seq_len")
        super().__init__(SampleOrder(n_windows, micro_batch_size, grad_accum, dp_rank, dp_size, seed, shuffle))

    def rows(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Window w is tokens[w*L : w*L + L + 1]: inputs its first L tokens, labels its last L."""
        L = self.seq_len
        x = torch.from_numpy(np.stack([self.tokens[w * L : w * L + L + 1] for w in ids]).astype(np.int64))
        return x[:, :-1], x[:, 1:]


def build_packed_loader(files: list[Path], tokenizer: Tokenizer, text_field: str, cache_dir: Path, *, seq_len: int,
                        micro_batch_size: int, grad_accum: int, dp_rank: int, dp_size: int, seed: int, shuffle: bool,
                        is_builder: bool, barrier: Callable[[], None]) -> tuple[PackedLoader, dict]:
    """One rank per machine tokenises (or finds the cache); the others wait, then all memory-map it.

    Returns the loader and the token file's meta: dtype, documents, tokens."""
    path = cache_dir / f"{cache_key(files, tokenizer, text_field)}.bin"
    if is_builder:
        build_token_file(files, tokenizer, text_field, cache_dir)
    barrier()
    tokens, meta = open_token_file(path)
    if meta["tokens"] == 0:
        raise DataError("the corpus is empty: no non-empty documents found in data.path")
    loader = PackedLoader(tokens, seq_len, micro_batch_size, grad_accum, dp_rank, dp_size, seed, shuffle)
    return loader, meta


def data_stats(format: str, *, documents: int, samples: int, tokens: int, loss_tokens: int, rows: int,
               fill: float, truncated: int = 0, dropped: int = 0, template: str | None = None) -> dict:
    """What `build_loader` reports, the same keys for every data.format:

    format (text | sft), documents (text: non-empty documents; sft: records), samples (kept: text:
    the documents; sft: samples with an answer token left), tokens (text: the token file, one EOS per
    document; sft: the kept samples' tokens after truncation), loss_tokens (target tokens in one epoch),
    rows (rows of seq_len in one epoch, = loader.n_rows), fill (non-padding share of the rows),
    truncated / dropped (sft: samples cut to seq_len + 1 / left with no answer token; text: 0),
    template (sft: chat_template | plain; text: None).
    """
    return {"format": format, "documents": documents, "samples": samples, "tokens": tokens,
            "loss_tokens": loss_tokens, "rows": rows, "fill": fill, "truncated": truncated, "dropped": dropped,
            "template": template}


def build_loader(cfg, tokenizer: Tokenizer, dp_rank: int, dp_size: int, is_builder: bool,
                 barrier: Callable[[], None], log: Callable[[str], None] = print,
                 files: list[Path] | None = None) -> tuple[RowLoader, dict]:
    """The loader `cfg.data.format` names, for this dp rank, and its stats (`data_stats`).

    text: `build_packed_loader` (`is_builder` ranks tokenise into the cache, `barrier` waits for
    them); sft: `shardlm.data.sft.build_sft_loader` with the tokenizer's folder's chat template
    (every rank reads the records; it logs one line about them). `files` defaults to the files of
    cfg.data.path.
    """
    d, t = cfg.data, cfg.train
    files = resolve_files(d.path) if files is None else files
    order = dict(seq_len=d.seq_len, micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum, dp_rank=dp_rank,
                 dp_size=dp_size, seed=t.seed, shuffle=d.shuffle)
    if d.format == "sft":
        loader, s = build_sft_loader(files, tokenizer, tokenizer.directory, pack=d.pack, **order)
        log(f"sft data: {s['samples']} samples ({s['truncated']} truncated to data.seq_len, "
            f"{s['dropped']} dropped with no answer left), {s['loss_tokens']} loss tokens, "
            f"{_TEMPLATE_WORDS.get(s['template'], s['template'])}, {'packed' if d.pack else 'padded'} into {loader.n_rows} rows")
        return loader, data_stats("sft", documents=s["records"], samples=s["samples"], tokens=s["tokens"],
                                  loss_tokens=s["loss_tokens"], rows=s["rows"], fill=s["fill"],
                                  truncated=s["truncated"], dropped=s["dropped"], template=s["template"])
    cache = Path(d.cache_dir) if d.cache_dir else default_cache_dir()
    loader, meta = build_packed_loader(files, tokenizer, d.text_field, cache, is_builder=is_builder, barrier=barrier,
                                       **order)
    return loader, data_stats("text", documents=meta["documents"], samples=meta["documents"], tokens=meta["tokens"],
                              loss_tokens=loader.n_rows * d.seq_len, rows=loader.n_rows, fill=1.0)
