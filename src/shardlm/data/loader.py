"""`build_loader`, the one entry point that builds the loader `data.format` names: text from token stores
(`shardlm.data.store`; raw files are prepared into one in the cache first), packed into `seq_len` windows
(with document masks when asked), one source or a mixture; SFT records.

The windows are dealt in the global sample order of `shardlm.data.order.SampleOrder` (or, for a mixture,
`shardlm.data.mixture.MixtureOrder`; the same for the SFT loader): the global batch holds the same samples
whatever the number of ranks, and the only state is the samples consumed, so a resume on a different dp
degree continues exactly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from shardlm.config import DataSection, EvalSection
from shardlm.data.chat import SHAPES, load_template
from shardlm.data.mixture import MixtureOrder
from shardlm.data.order import IGNORE_INDEX, RowLoader, SampleOrder
from shardlm.data.packing import document_rows
from shardlm.data.sft import SFTLoader, SFTSamples, sft_stats
from shardlm.data.sources import parse_sources
from shardlm.data.store.cache import default_cache_dir
from shardlm.data.store.format import TokenStore, is_store
from shardlm.data.store.prepare import ensure_cached_store, files_spec
from shardlm.data.tokenizer import Tokenizer
from shardlm.errors import ConfigError, DataError

__all__ = ["IGNORE_INDEX", "MixtureLoader", "PackedLoader", "build_loader", "build_text_loader", "data_stats",
           "default_cache_dir", "open_stores", "open_val_store"]


_TEMPLATE_WORDS = {"chat_template": "the tokenizer's chat template", "plain": "plain ### User/### Assistant template"}


class PackedLoader(RowLoader):
    """This rank's micro-batches of `seq_len` windows of the token stream, in the global sample order.

    With `doc_starts` (the store's document offsets; data.document_mask) each micro-batch is (inputs, labels,
    positions): positions restart at every document and the target across a boundary is dropped."""

    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch_size: int, grad_accum: int,
                 dp_rank: int, dp_size: int, seed: int = 0, shuffle: bool = True, doc_starts: np.ndarray | None = None,
                 order: SampleOrder | None = None):
        self.tokens, self.seq_len, self.doc_starts = tokens, seq_len, doc_starts
        n_windows = self.windows(tokens, seq_len)
        if n_windows < 1:
            raise DataError(f"the corpus has {len(tokens)} tokens, fewer than data.seq_len + 1 = {seq_len + 1}; "
                            "add text or lower data.seq_len")
        super().__init__(order or SampleOrder(n_windows, micro_batch_size, grad_accum, dp_rank, dp_size, seed, shuffle))

    @staticmethod
    def windows(tokens: np.ndarray, seq_len: int) -> int:
        return (len(tokens) - 1) // seq_len if len(tokens) > 0 else 0

    def rows(self, ids: list[int]) -> tuple[torch.Tensor, ...]:
        """Window w is tokens[w*L : w*L + L + 1]: inputs its first L tokens, labels its last L."""
        return self._read(ids, (0, 1))

    def local_rows(self, ids: list[int]) -> tuple[torch.Tensor, ...]:
        """Under parallel.cp: only this rank's `seq_len / cp` tokens of each window are read (and the one after,
        its last label); positions, for the whole row, come from the document offsets alone."""
        return self._read(ids, (self.cp_rank, self.cp_size))

    def _read(self, ids: list[int], cp: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        if self.doc_starts is not None:
            return document_rows(self.tokens, self.doc_starts, list(ids), self.seq_len, cp)
        L, t = self.seq_len, self.seq_len // cp[1]
        lo = cp[0] * t
        x = torch.from_numpy(np.stack([self.tokens[w * L + lo : w * L + lo + t + 1] for w in ids]).astype(np.int64))
        return x[:, :-1], x[:, 1:]


class MixtureLoader(RowLoader):
    """Micro-batches drawn from several sources' windows in a `MixtureOrder` (per-sample interleave)."""

    def __init__(self, sources: list[PackedLoader], order: MixtureOrder):
        self.sources = sources
        super().__init__(order)  # type: ignore[arg-type]

    def rows(self, ids: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
        parts = [self.sources[s].rows([r]) for s, r in ids]
        return tuple(torch.cat(col) for col in zip(*parts))

    def set_context_parallel(self, rank: int, size: int) -> None:
        super().set_context_parallel(rank, size)
        for s in self.sources:
            s.set_context_parallel(rank, size)

    def local_rows(self, ids: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
        parts = [self.sources[s].local_rows([r]) for s, r in ids]
        return tuple(torch.cat(col) for col in zip(*parts))

    @property
    def n_rows(self) -> int:
        return sum(self.order.n_rows)  # type: ignore[arg-type]


# -- text data: token stores --------------------------------------------------------------------------------

def _open_store(data: DataSection, path: str, tokenizer: Tokenizer, what: str = "data.path") -> TokenStore:
    """A store named by the config: its kind must be data.format's, its tokenizer (and, for SFT, its chat
    template) the run's."""
    store = TokenStore.open(path)
    fmt = data.format
    if store.kind != fmt:
        how = "`shardlm prepare ... --data.format sft`" if fmt == "sft" else "`shardlm prepare` (data.format=text)"
        raise ConfigError(f"{what} {path!r} is a token store of {store.kind} data but data.format={fmt}; "
                          f"set data.format={store.kind}, or prepare the files with {how}")
    store.check_tokenizer(tokenizer, "the run's tokenizer" if what != "data.path" else "the model's tokenizer")
    if fmt == "sft":
        store.check_template(load_template(tokenizer, tokenizer.directory))
    return store


def open_stores(data: DataSection, tokenizer: Tokenizer, log: Callable[[str], None] = print,
                wait_log: Callable[[str], None] | None = None, tokenizer_spec: str | None = None) -> list[TokenStore]:
    """The token store of data.path (or of each source), text or SFT as data.format says: opened when it is
    one (its tokenizer, and chat template, must be the run's), else prepared from the raw files in
    data.cache_dir (`ensure_cached_store`). Call it before the process group starts: a long preparation then
    never trips a collective's timeout. `tokenizer_spec`: what a prepared store records as its tokenizer
    (the run's resolved data.tokenizer; default: the tokenizer's own file)."""
    d = data
    cache = Path(d.cache_dir) if d.cache_dir else default_cache_dir()
    stores = []
    for path, _, _, text_field in parse_sources(d):
        if is_store(path):
            store = _open_store(d, path, tokenizer)
            if d.format == "text" and store.manifest.get("text_field") != text_field and text_field != "text":
                log(f"data: note: {store.path} was prepared from field {store.manifest.get('text_field')!r}; "
                    f"data.text_field={text_field!r} does not apply to a store")
        else:
            spec = files_spec(path, tokenizer, tokenizer_spec or tokenizer.spec, text_field, d.format)
            store = ensure_cached_store(spec, cache, workers=d.prepare_workers, max_bad_fraction=d.max_bad_fraction,
                                        log=log, wait_log=wait_log)
        if d.verify and os.environ.get("LOCAL_RANK", "0") == "0":  # one reader per node's copy
            log(f"data: verifying {store.path} (data.verify: sha256 of every file)")
            store.verify()
        if d.format == "sft" and store.documents == 0:
            raise DataError(f"no SFT records found in {path} (each record must be one of {SHAPES})")
        if store.n_tokens == 0:
            raise DataError(f"the corpus is empty: no non-empty documents found in {path}")
        stores.append(store)
    return stores


def open_val_store(data: DataSection, eval_cfg: EvalSection, tokenizer: Tokenizer, log: Callable[[str], None] = print,
                   wait_log: Callable[[str], None] | None = None,
                   tokenizer_spec: str | None = None) -> TokenStore | None:
    """The validation store: data.val_path (a store, or files prepared into the cache like training's), else
    the `val/` of the training store when data.path is one (and `eval_cfg` evaluates); None when there is
    none. `tokenizer_spec`: as `open_stores`."""
    d = data
    if d.val_path:
        if is_store(d.val_path):
            store = _open_store(d, d.val_path, tokenizer, "data.val_path")
            if d.verify and os.environ.get("LOCAL_RANK", "0") == "0":
                store.verify()
            return store
        cache = Path(d.cache_dir) if d.cache_dir else default_cache_dir()
        spec = files_spec(d.val_path, tokenizer, tokenizer_spec or tokenizer.spec, d.text_field, d.format)
        return ensure_cached_store(spec, cache, workers=d.prepare_workers, max_bad_fraction=d.max_bad_fraction,
                                   log=log, wait_log=wait_log)
    if not (eval_cfg.interval or eval_cfg.at_end):
        return None  # no evaluation: a store's val/ is not needed (nor checked)
    if not d.sources and is_store(d.path):
        return TokenStore.open(d.path).val()
    return None


def mixture_val_stores(data: DataSection, eval_cfg: EvalSection,
                       log: Callable[[str], None] = print) -> list[tuple[str, TokenStore]]:
    """A mixture without data.val_path: (name, val store) of each source that is a token store prepared with a
    validation split (its own `val/`); a note names the sources without one. Empty when none has one, or when
    `eval_cfg` never evaluates."""
    d = data
    if not d.sources or d.val_path or not (eval_cfg.interval or eval_cfg.at_end):
        return []
    found, without = [], []
    for path, *_ in parse_sources(d):
        val = TokenStore.open(path).val() if is_store(path) else None
        name = Path(str(path).removeprefix("store:")).name or str(path)
        (found.append((name, val)) if val is not None else without.append(name))
    if found and without:
        log(f"data: validation on the val/ of {', '.join(n for n, _ in found)}; {', '.join(without)} "
            "has none (raw files, or a store prepared without --val-fraction / --val): not evaluated")
    return found


def build_text_loader(data: DataSection, stores: list[TokenStore], dp_rank: int, dp_size: int, *,
                      micro_batch_size: int, grad_accum: int, seed: int,
                      log: Callable[[str], None] = print) -> RowLoader:
    """The text loader over `stores` (one per source): a PackedLoader, or a MixtureLoader over [[data.sources]]."""
    d = data
    order = dict(micro_batch_size=micro_batch_size, grad_accum=grad_accum, dp_rank=dp_rank, dp_size=dp_size,
                 seed=seed, shuffle=d.shuffle)

    def packed(store: TokenStore, **kw) -> PackedLoader:
        starts = np.asarray(store.starts[:-1]) if d.document_mask else None
        return PackedLoader(store.tokens, d.seq_len, doc_starts=starts, **order, **kw)

    if not d.sources:
        return packed(stores[0])
    sources = parse_sources(d)
    names = [Path(s.path).name or s.path for s in sources]
    n_rows = [PackedLoader.windows(s.tokens, d.seq_len) for s in stores]
    for name, n in zip(names, n_rows):
        if n < 1:
            raise DataError(f"data source {name}: fewer than data.seq_len + 1 = {d.seq_len + 1} tokens; add text, "
                            "drop the source or lower data.seq_len")
    mix = MixtureOrder(n_rows, [s.weight for s in sources], epochs=[s.epochs for s in sources], names=names,
                       **order)
    # each source's own order is unused (the mixture picks its rows); a 1-row stand-in keeps it tiny
    dummy = SampleOrder(1, micro_batch_size, grad_accum, 0, 1)
    return MixtureLoader([packed(s, order=dummy) for s in stores], mix)


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


def build_loader(data: DataSection, tokenizer: Tokenizer, dp_rank: int, dp_size: int, *, micro_batch_size: int,
                 grad_accum: int, seed: int, log: Callable[[str], None] = print,
                 stores: list[TokenStore] | None = None, vocab_size: int = 0,
                 cp: tuple[int, int] = (0, 1)) -> tuple[RowLoader, dict]:
    """The loader `data.format` names, for this dp rank, and its stats (`data_stats`). `micro_batch_size`,
    `grad_accum`, `seed`: train's (rows per micro-batch, micro-batches per step, the order's seed).
    `vocab_size` (the model's): every micro-batch's ids are checked against it, so damaged store bytes stop
    with one line naming the stores; `cp`: (this rank's index in its CP group, parallel.cp), the slice of
    every row it reads (`RowLoader.set_context_parallel`).

    text: the token store(s) (`stores`, default `open_stores`) as a PackedLoader, or a MixtureLoader over
    [[data.sources]]; sft: an SFTLoader over the SFT store (samples rendered with the tokenizer's folder's chat
    template; it logs one line about them).
    """
    d = data
    stores = open_stores(d, tokenizer, log) if stores is None else stores
    loader, stats = _build(d, tokenizer, stores, dp_rank, dp_size, micro_batch_size, grad_accum, seed, log)
    loader.vocab_size, loader.source = vocab_size, ", ".join(str(s.path) for s in stores)
    loader.set_context_parallel(*cp)
    return loader, stats


def _build(d: DataSection, tokenizer: Tokenizer, stores: list[TokenStore], dp_rank: int, dp_size: int,
           micro_batch_size: int, grad_accum: int, seed: int, log: Callable[[str], None]) -> tuple[RowLoader, dict]:
    if d.format == "sft":
        loader = SFTLoader(SFTSamples.from_store(stores[0]), d.seq_len, micro_batch_size, grad_accum, dp_rank,
                           dp_size, seed, d.shuffle, d.pack, pad_id=tokenizer.eos_id, document_mask=d.document_mask)
        s = sft_stats(loader, stores[0], stores[0].manifest["template"]["name"])
        log(f"sft data: {s['samples']} samples ({s['truncated']} truncated to data.seq_len, "
            f"{s['dropped']} dropped with no answer left), {s['loss_tokens']} loss tokens, "
            f"{_TEMPLATE_WORDS.get(s['template'], s['template'])}, {'packed' if d.pack else 'padded'} into {loader.n_rows} rows")
        return loader, data_stats("sft", documents=s["records"], samples=s["samples"], tokens=s["tokens"],
                                  loss_tokens=s["loss_tokens"], rows=s["rows"], fill=s["fill"],
                                  truncated=s["truncated"], dropped=s["dropped"], template=s["template"])
    loader = build_text_loader(d, stores, dp_rank, dp_size, micro_batch_size=micro_batch_size, grad_accum=grad_accum,
                               seed=seed, log=log)
    docs, tokens = sum(s.documents for s in stores), sum(s.n_tokens for s in stores)
    return loader, data_stats("text", documents=docs, samples=docs, tokens=tokens,
                              loss_tokens=loader.n_rows * d.seq_len, rows=loader.n_rows, fill=1.0)
