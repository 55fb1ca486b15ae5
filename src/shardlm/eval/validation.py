"""Validation loss in the training loop: one fixed set, one number, the same on any number of ranks.

The set: the validation store's rows, in order, never shuffled (the first `eval.max_tokens // seq_len` of them,
or all). Text: the `seq_len` windows of its token stream, with document masks when the run uses them; SFT: its
samples packed (or padded) as training packs them, answer tokens only. Rows are dealt round-robin over
the data-parallel ranks (every rank of the mesh: FSDP and HSDP alike); a rank with fewer rows runs forwards on a
padding row (no targets) so that every rank makes the same FSDP all-gathers.

val_loss = (sum over every target token of the set of -log p) / (number of target tokens), summed in fp64 over
the ranks with one all-reduce: not a mean of batch means, so it is the same on 1, 2 or 4 ranks and under HSDP (up
to float reduction order). val_ppl = exp(val_loss); val_bpb (text only) = the summed nats / ln 2 / the UTF-8
bytes of the evaluated text, which compares models with different tokenizers.

Evaluation runs under `torch.no_grad` in eval mode (no dropout: the RNG stream of training is not touched) on the
training model itself (its FSDP sharding, no copy), and does not touch the training loader: the training losses
are the same with and without it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shardlm.config import DataSection, EvalSection
from shardlm.data.loader import PackedLoader
from shardlm.data.order import IGNORE_INDEX, SampleOrder, check_ids, context_slice
from shardlm.data.sft import SFTLoader, SFTSamples
from shardlm.errors import ConfigError, DataError


class Due:
    def due(self, step: int, final: bool, stopped: bool) -> bool:
        """Whether step `step` ends with an evaluation: a multiple of eval.interval, or the last step with
        eval.at_end (not when stopping early: a SIGTERM's grace is for the checkpoint). Alike on every rank."""
        e = self.eval_cfg
        return bool(e.interval and step % e.interval == 0) or (e.at_end and final and not stopped)


class Validator(Due):
    """The fixed validation set of `store` for this rank, and `evaluate(model)` over it (a collective).
    `micro_batch_size`, `loss_chunk_tokens`: training's (eval.micro_batch_size = 0 takes its rows per forward);
    `cp`: (this rank's index in its CP group, parallel.cp): the slice of each row it reads."""

    def __init__(self, data: DataSection, eval_cfg: EvalSection, store, tokenizer, dp_rank: int, dp_size: int,
                 device: torch.device, *, micro_batch_size: int, loss_chunk_tokens: int,
                 cp: tuple[int, int] = (0, 1)):
        d, e = data, eval_cfg
        self.eval_cfg = e
        self.device, self.dp_rank, self.dp_size, self.path = device, dp_rank, dp_size, store.path
        self.mbs = e.micro_batch_size or micro_batch_size
        self.loss_chunk_tokens = loss_chunk_tokens  # as training: never the full fp32 logits
        self.seq_len = L = d.seq_len
        one = SampleOrder(1, 1, 1, 0, 1)  # the loaders' own order is unused: rows are asked for by index
        if store.kind == "sft":
            self.rows_of = SFTLoader(SFTSamples.from_store(store), L, 1, 1, 0, 1, shuffle=False, pack=d.pack,
                                     pad_id=tokenizer.eos_id, document_mask=d.document_mask)
            n_rows = self.rows_of.n_rows if not e.max_tokens else max(1, min(self.rows_of.n_rows, e.max_tokens // L))
            self.bytes = None
        else:
            n_windows = PackedLoader.windows(store.tokens, L)
            if n_windows < 1:
                raise DataError(f"the validation store {store.path} has {store.n_tokens} tokens, fewer than "
                                f"data.seq_len + 1 = {L + 1}; add validation data or lower data.seq_len")
            n_rows = n_windows if not e.max_tokens else max(1, min(n_windows, e.max_tokens // L))
            starts = np.asarray(store.starts[:-1]) if d.document_mask else None
            self.rows_of = PackedLoader(store.tokens, L, 1, 1, 0, 1, doc_starts=starts, order=one)
            self.bytes = _utf8_bytes(tokenizer, store.tokens[1 : n_rows * L + 1])
        self.rows_of.set_context_parallel(*cp)
        self.n_rows = n_rows
        self.mine = list(range(dp_rank, n_rows, dp_size))
        per_rank = -(-n_rows // dp_size)
        self.forwards = -(-per_rank // self.mbs)  # the same on every rank
        self.pad_id, self.positions = tokenizer.eos_id, d.document_mask

    def describe(self) -> str:
        what = f"{self.n_rows} rows of {self.seq_len}"
        return what + (f", {self.forwards} forwards of {self.mbs} per rank")

    def _batches(self):
        for k in range(self.forwards):
            ids = self.mine[k * self.mbs : (k + 1) * self.mbs]
            if not ids:  # this rank ran out: a padding row keeps its FSDP collectives in step with the others
                x = torch.full((1, self.seq_len), self.pad_id, dtype=torch.long)
                y = torch.full((1, self.seq_len), IGNORE_INDEX, dtype=torch.long)
                batch = (x, y, torch.arange(self.seq_len).unsqueeze(0)) if self.positions else (x, y)
                yield context_slice(batch, self.rows_of.cp_rank, self.rows_of.cp_size)
                continue
            yield self.rows_of.local_rows(ids)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict[str, Any]:
        """val_loss, val_ppl, val_bpb (text; None for SFT), val_tokens, val_time_s: one collective at the end
        (besides the forwards' own)."""
        t0 = time.perf_counter()
        sums = self.local_sums(model).unsqueeze(0)
        if dist.is_initialized():
            dist.all_reduce(sums)
        return _metrics(sums[0].tolist(), self.bytes, t0)

    def local_sums(self, model: torch.nn.Module) -> torch.Tensor:
        """[sum of -log p, target tokens] over this rank's rows (fp64), before the all-reduce."""
        was_training = model.training
        model.eval()
        nll = torch.zeros((), dtype=torch.float64)
        count = 0
        try:
            vocab = getattr(getattr(model, "cfg", None), "vocab_size", 0)
            for batch in self._batches():
                if vocab:  # damaged validation bytes: one line, not a device-side assert
                    check_ids(batch[0], batch[1], vocab, f"the validation store {self.path}", 0)
                x, y, *pos = (b.to(self.device, non_blocking=True) for b in batch)
                loss = model(x, *pos, labels=y, loss_chunk_tokens=self.loss_chunk_tokens)
                nll += loss.double().cpu()
                count += int((y != IGNORE_INDEX).sum())
        finally:
            model.train(was_training)
        return torch.tensor([nll.item(), float(count)], dtype=torch.float64)


def _metrics(sums: list[float], n_bytes: int | None, t0: float) -> dict[str, Any]:
    total, n = sums
    if n == 0:
        raise DataError("the validation set has no target tokens (every SFT answer cut off?); raise "
                        "data.seq_len or check data.val_path")
    loss = total / n
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)),
            "val_bpb": total / math.log(2) / n_bytes if n_bytes else None,
            "val_tokens": int(n), "val_time_s": time.perf_counter() - t0}


class MixtureValidation(Due):
    """A mixture's validation: each source store's own `val/`, one Validator each (eval.max_tokens split evenly
    between them). val_loss is over every target token of all of them (sums, one all-reduce for all), and each
    source's own val_loss is in the record as `val_loss/<name>`."""

    def __init__(self, data: DataSection, eval_cfg: EvalSection, stores: list, names: list[str], tokenizer,
                 dp_rank: int, dp_size: int, device: torch.device, *, micro_batch_size: int, loss_chunk_tokens: int,
                 cp: tuple[int, int] = (0, 1)):
        share = eval_cfg.max_tokens // len(stores) if eval_cfg.max_tokens else 0
        each = dataclasses.replace(eval_cfg, max_tokens=share) if share else eval_cfg
        self.parts = [Validator(data, each, s, tokenizer, dp_rank, dp_size, device, micro_batch_size=micro_batch_size,
                                loss_chunk_tokens=loss_chunk_tokens, cp=cp) for s in stores]
        self.eval_cfg = eval_cfg
        self.names = names
        self.n_rows = sum(v.n_rows for v in self.parts)

    def describe(self) -> str:
        return "; ".join(f"{name}: {v.describe()}" for name, v in zip(self.names, self.parts))

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict[str, Any]:
        t0 = time.perf_counter()
        sums = torch.stack([v.local_sums(model) for v in self.parts])
        if dist.is_initialized():
            dist.all_reduce(sums)
        n_bytes = [v.bytes for v in self.parts]
        out = _metrics(sums.sum(0).tolist(), sum(n_bytes) if all(n_bytes) else None, t0)
        for name, (total, n) in zip(self.names, sums.tolist()):
            out[f"val_loss/{name}"] = total / n if n else None
        return out


def needs_validation(data: DataSection, eval_cfg: EvalSection, val_store, val_sources: list) -> None:
    """eval.interval without validation data is a ConfigError naming where the data can come from."""
    e = eval_cfg
    if val_store is None and not val_sources and e.interval:
        how = ("mix token stores prepared with --val-fraction / --val (each source's val/ is used)"
               if data.sources else "train on a store prepared with --val-fraction / --val")
        raise ConfigError(f"eval.interval={e.interval} needs validation data: set data.val_path (a store or "
                          f"files), or {how}; or eval.interval=0")


def build_validator(data: DataSection, eval_cfg: EvalSection, val_store, val_sources: list, tokenizer,
                    dp_rank: int, dp_size: int, device: torch.device, *, micro_batch_size: int,
                    loss_chunk_tokens: int, cp: tuple[int, int] = (0, 1)) -> Validator | MixtureValidation | None:
    """The run's validation: over `val_store`, or over each (name, store) of a mixture's `val_sources`; None
    when the run never evaluates (eval.interval=0 and eval.at_end=false) or has nothing to evaluate on.
    `micro_batch_size`, `loss_chunk_tokens`: training's; `cp`: this rank's slice of the rows (`Validator`)."""
    if not (eval_cfg.interval or eval_cfg.at_end):
        return None
    train = dict(micro_batch_size=micro_batch_size, loss_chunk_tokens=loss_chunk_tokens, cp=cp)
    if val_store is not None:
        return Validator(data, eval_cfg, val_store, tokenizer, dp_rank, dp_size, device, **train)
    if val_sources:
        return MixtureValidation(data, eval_cfg, [v for _, v in val_sources], [n for n, _ in val_sources], tokenizer,
                                 dp_rank, dp_size, device, **train)
    return None


def _utf8_bytes(tokenizer, ids: np.ndarray, chunk: int = 1 << 20) -> int | None:
    """UTF-8 bytes of the text the target tokens spell (end-of-text tokens spell none); None when the tokenizer
    cannot say (a decode error). Decoded in chunks: a character cut between two chunks is counted in full
    (the tokenizer replaces a partial one with U+FFFD, 3 bytes: off by at most a few bytes per million)."""
    try:
        return sum(len(tokenizer.decode(ids[a : a + chunk].tolist()).encode("utf-8"))
                   for a in range(0, len(ids), chunk)) or None
    except Exception:  # a tokenizer without a usable decoder: no bits per byte
        return None


def best_logged(metrics_file: Path, up_to: int) -> tuple[float, int] | None:
    """The lowest val_loss in a metrics.jsonl (steps <= up_to: what a resumed run carries over) and its step."""
    best = None
    try:
        lines = metrics_file.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict) and isinstance(r.get("val_loss"), (int, float)) and r.get("step", up_to + 1) <= up_to:
            if best is None or r["val_loss"] < best[0]:
                best = (float(r["val_loss"]), int(r["step"]))
    return best
