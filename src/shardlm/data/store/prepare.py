"""Preparing a token store (its format: `shardlm.data.store.format`): `prepare(spec, out)`.

The input is cut into units (`shardlm.data.sources.plan_units`: a row group, a record batch, a byte range of
a .jsonl, a file), grouped into jobs (`UnitJob`), each tokenised on its own by a pool of worker processes into
`<out>.partial/parts/`, then the parts are joined in job order: the bytes do not depend on the number of
workers. A killed prepare keeps its finished parts and a rerun continues from them; the store appears (one
rename) only when complete. Memory is bounded by a batch of documents per worker and a copy buffer, not by
the corpus.

Training on raw files goes through the same code: `ensure_cached_store` prepares a store in the data cache
(`shardlm.data.store.cache`) before the process group starts, once per shared filesystem.

The worker processes import this module without torch (seconds per worker at start-up): `shardlm.data.chat`
(jinja2 for chat templates) is imported by the functions that need it, in SFT prepares only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from shardlm.data.sources import BadRecords, Unit, is_stdlib, plan_units, read_texts, resolve_sources, skipped_line
from shardlm.data.store.cache import LOCK_REFRESH_S, LOCK_STALE_S, cached_store
from shardlm.data.store.format import (FORMAT, MANIFEST, VERSION, TokenStore, join_parts, partial_dir, token_dtype,
                                       with_ext, write_manifest)
from shardlm.data.tokenizer import Tokenizer, encode_texts, load_tokenizer
from shardlm.disk import disk_error
from shardlm.errors import ConfigError, say
from shardlm.fsutil import FileLock, staged, swap_in
from shardlm.data.chat import answer_info, load_template, record_key, tokenize_records, unit_messages


@dataclass
class PrepareSpec:
    """Everything a store's bytes depend on; its `key()` names a cached store and guards a resumed prepare."""

    files: list[Path]
    tokenizer: str  # the spec load_tokenizer takes (in each worker)
    fingerprint: str
    text_field: str = "text"
    val_fraction: float = 0.0
    val_files: list[Path] = field(default_factory=list)
    seed: int = 0
    chunk_bytes: int = 0  # 0: auto_chunk_bytes(files), resolved at construction (it shapes the units, so the key)
    kind: str = "text"  # or "sft": records -> samples with answer masks
    template_dir: str | None = None  # sft: the folder whose chat template renders the records (None: plain)
    template: dict | None = None  # sft: {"name", "fingerprint"} of that template (set at construction)

    def __post_init__(self) -> None:
        if not self.chunk_bytes:
            self.chunk_bytes = auto_chunk_bytes(self.files + self.val_files)
        if self.kind not in ("text", "sft"):
            raise ValueError(f"kind must be text or sft, got {self.kind!r}")
        if self.kind == "sft" and self.template is None:
            t = load_template(load_tokenizer(self.tokenizer), self.template_dir)
            self.template = {"name": t.name, "fingerprint": t.fingerprint}

    def sources(self, files: list[Path] | None = None) -> list[dict]:
        out = []
        for f in self.files if files is None else files:
            st = f.stat()
            out.append({"path": str(f.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
        return out

    def to_dict(self) -> dict:
        d = {"sources": self.sources(), "val_sources": self.sources(self.val_files),
             "tokenizer": self.fingerprint, "text_field": self.text_field, "val_fraction": self.val_fraction,
             "seed": self.seed, "chunk_bytes": self.chunk_bytes}
        return d if self.kind == "text" else {**d, "kind": self.kind, "template": self.template}

    def key(self) -> str:
        blob = json.dumps({"format": FORMAT, "version": VERSION, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]


MIN_CHUNK, MAX_CHUNK = 1 << 20, 64 << 20
POOL_BYTES_PER_WORKER = 32 << 20  # less input per worker than this: spawning the worker costs more than it saves


def auto_chunk_bytes(files: list[Path]) -> int:
    """Units of about 1/64 of the input, between 1 and 64 MiB: enough units for the workers of a big machine,
    from the input sizes only (the store's bytes must not depend on the machine)."""
    total = sum(f.stat().st_size for f in files)
    return max(MIN_CHUNK, min(MAX_CHUNK, total // 64))


def in_val(text: str, seed: int, fraction: float) -> bool:
    """A document's split, from its content and the seed only: the same on every machine, whatever the
    workers, the units or the order; duplicates land on the same side (no train/val leak through them)."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8,
                             key=seed.to_bytes(8, "little", signed=True)).digest()
    return int.from_bytes(digest, "little") < fraction * 2.0 ** 64


# -- the workers: one job (a group of units) -> its parts ---------------------------------------------------

@dataclass(frozen=True)
class UnitJob:
    """One group of units to tokenise into parts/<split>-<index>.*: everything a worker needs (picklable)."""

    index: int
    units: list[Unit]
    split: str  # "train" or "val" (the files of --val)
    parts: str  # the parts folder
    text_field: str
    val_fraction: float  # > 0: documents `in_val` go to the .val part
    seed: int
    dtype: str  # the token dtype's name
    eos: int
    kind: str  # "text" or "sft"

    @property
    def base(self) -> Path:
        """The parts' common path (+ .bin, .len, ...; .json, written last, marks the job done)."""
        return Path(self.parts) / f"{self.split}-{self.index:06d}"

    def done(self) -> bool:
        return with_ext(self.base, ".json").is_file()

    def input_bytes(self) -> int:
        return sum(_unit_bytes(u) for u in self.units)


# Worker state (one per process of the pool, set by _init_worker)
_W: dict[str, Any] = {}


def _init_worker(tokenizer: str, counters: Any, pool: bool = True, kind: str = "text",
                 template_dir: str | None = None) -> None:
    if pool:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per core already
    _W["tok"], _W["counters"] = load_tokenizer(tokenizer), counters
    if kind == "sft":
        _W["template"] = load_template(_W["tok"], template_dir)


class _Part:
    """One output (train or val) of one unit: ids appended to a .bin, document lengths collected; with `sft`,
    samples: ids (no EOS added) with their answer mask (.mask) and per-sample answer info (.ans)."""

    def __init__(self, path: Path, dtype: np.dtype, eos: int, sft: bool = False):
        self.path, self.dtype, self.sft = path, dtype, sft
        self.eos = np.array([eos], dtype=dtype).tobytes()
        self.f = open(with_ext(path, ".bin.tmp"), "wb")
        self.m = open(with_ext(path, ".mask.tmp"), "wb") if sft else None
        self.lengths: list[int] = []
        self.answers: list[tuple[int, int]] = []

    def add(self, ids: np.ndarray) -> None:
        self.f.write(ids.astype(self.dtype, copy=False).tobytes())
        self.f.write(self.eos)
        self.lengths.append(int(ids.size) + 1)

    def add_sample(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self.f.write(ids.astype(self.dtype, copy=False).tobytes())
        self.m.write(np.asarray(mask, dtype=np.uint8).tobytes())  # type: ignore[union-attr]
        self.lengths.append(int(ids.size))
        self.answers.append(answer_info(mask))

    def finish(self) -> dict:
        self.f.close()
        names = [".bin", ".len"]
        np.asarray(self.lengths, dtype=np.int64).tofile(with_ext(self.path, ".len.tmp"))
        if self.m is not None:
            self.m.close()
            np.asarray(self.answers, dtype=np.int64).reshape(-1, 2).tofile(with_ext(self.path, ".ans.tmp"))
            names += [".mask", ".ans"]
        for ext in names:
            os.replace(with_ext(self.path, ext + ".tmp"), with_ext(self.path, ext))
        return {"documents": len(self.lengths), "tokens": int(sum(self.lengths))}


def _unit_bytes(u: Unit) -> int:
    """About how much input a unit is (a byte range's length, else its file's size; a row group or record
    batch counts its whole file: an overestimate that only errs towards more workers)."""
    return u.stop - u.start if u.stop >= 0 else os.path.getsize(u.path)


def _groups(units: list[Unit], group_bytes: int) -> list[list[Unit]]:
    """Consecutive whole-file units (.txt, .py) grouped up to `group_bytes` (one part each, not thousands of
    tiny ones); every other unit alone. From the file sizes only: deterministic."""
    out: list[list[Unit]] = []
    size = 0
    for u in units:
        if u.kind == "text" and out and out[-1][-1].kind == "text" and size < group_bytes:
            out[-1].append(u)
        else:
            out.append([u])
            size = 0
        size += os.path.getsize(u.path) if u.kind == "text" else 0
    return out


def _prepare_unit(job: UnitJob) -> dict:
    """Tokenise one job's units into its parts (+ .val.*; sft: + .mask, .ans); its .json, written last, marks
    it done."""
    tok, counters = _W["tok"], _W.get("counters")
    dtype, base, sft = np.dtype(job.dtype), job.base, job.kind == "sft"
    bad = BadRecords()
    train = _Part(base, dtype, job.eos, sft)
    val = _Part(with_ext(base, ".val"), dtype, job.eos, sft) if job.val_fraction > 0 else None
    pending = [0, 0]
    if sft:
        _sft_unit(job.units, tok, _W["template"], train, val, job.seed, job.val_fraction, bad, counters, pending)
        return _finish_unit(job.index, base, train, val, bad, [], counters, pending)
    stdlib_skipped: list[tuple[str, str]] = []
    buffered: list[str] = []
    for text in _unit_texts(job, bad, stdlib_skipped):
        buffered.append(text)
        if len(buffered) >= 256:
            _encode_into(tok, buffered, train, val, job.seed, job.val_fraction, counters, pending)
            buffered = []
    if buffered:
        _encode_into(tok, buffered, train, val, job.seed, job.val_fraction, counters, pending)
    return _finish_unit(job.index, base, train, val, bad, stdlib_skipped, counters, pending)


def _unit_texts(job: UnitJob, bad: BadRecords, stdlib_skipped: list[tuple[str, str]]) -> Iterator[str]:
    """The job's non-empty documents in order; its bad records go to `bad`, but the stdlib's files that are not
    UTF-8 (a few of its test files, on purpose) to `stdlib_skipped`."""
    for unit in job.units:
        got = BadRecords()
        for text in read_texts(unit, job.text_field, got):
            if text:
                yield text
        if got.bad and is_stdlib(unit.path):
            stdlib_skipped.append((unit.path, got.examples[0]))
        else:
            bad.merge(got)


def _sft_unit(units: list[Unit], tok: Tokenizer, template: Any, train: _Part, val: _Part | None, seed: int,
              fraction: float, bad: BadRecords, counters: Any, pending: list[int]) -> None:
    """SFT records -> rendered, tokenised samples (ids + answer mask), 256 records at a time."""
    def flush(batch: list) -> None:
        for (ids, mask), (messages, _) in zip(tokenize_records(batch, tok, template), batch):
            split_val = val is not None and in_val(record_key(messages), seed, fraction)
            (val if split_val else train).add_sample(ids, mask)  # type: ignore[union-attr]
            pending[0] += 1
            pending[1] += ids.size
        if pending[1] > 1 << 16:
            _count(counters, pending)

    batch: list = []
    for unit in units:
        for record in unit_messages(unit, bad):
            batch.append(record)
            if len(batch) >= 256:
                flush(batch)
                batch = []
    if batch:
        flush(batch)


def _finish_unit(i: int, base: Path, train: _Part, val: _Part | None, bad: BadRecords, stdlib_skipped: list,
                 counters: Any, pending: list[int]) -> dict:
    _count(counters, pending)
    result = {"unit": i, "train": train.finish(), "val": val.finish() if val else None, "bad": bad.to_dict(),
              "stdlib_skipped": stdlib_skipped}
    if delay := os.environ.get("SHARDLM_TEST_PREPARE_SLEEP"):  # tests: a prepare slow enough to be killed midway
        time.sleep(float(delay))
    with staged(with_ext(base, ".json"), tmp=with_ext(base, ".json.tmp")) as tmp:
        tmp.write_text(json.dumps(result))
    return result


def _encode_into(tok: Tokenizer, texts: list[str], train: _Part, val: _Part | None, seed: int, fraction: float,
                 counters: Any, pending: list[int]) -> None:
    for text, ids in zip(texts, encode_texts(tok, texts)):
        (val if val is not None and in_val(text, seed, fraction) else train).add(ids)
        pending[0] += 1
        pending[1] += ids.size + 1
    if pending[1] > 1 << 16:
        _count(counters, pending)


class _LocalCounters(list):
    """[documents, tokens] done, for a prepare without worker processes (the shared Array's interface)."""

    def __init__(self) -> None:
        super().__init__([0, 0])

    def get_lock(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def _count(counters: Any, pending: list[int]) -> None:
    if counters is not None and pending[0]:
        with counters.get_lock():
            counters[0] += pending[0]
            counters[1] += pending[1]
    pending[0] = pending[1] = 0


class _Progress:
    """Documents, tokens and tokens/s while a prepare runs: a tqdm bar on a terminal, else a line every 30 s."""

    def __init__(self, counters: Any, total_units: int, done_units: int, log: Callable[[str], None],
                 bar: bool | None = None):
        self.counters, self.total, self.done, self.log = counters, total_units, done_units, log
        self.t0 = time.monotonic()
        self.last_line = self.t0
        self.bar = None
        if bar if bar is not None else sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_units, initial=done_units, unit="part", dynamic_ncols=True,
                            desc="prepare", file=sys.stderr)

    def text(self) -> str:
        docs, toks = self.counters[0], self.counters[1]
        rate = toks / max(time.monotonic() - self.t0, 1e-9)
        return f"{docs:,} documents, {toks:,} tokens, {rate:,.0f} tokens/s"

    def update(self, parts_done: int = 0) -> None:
        self.done += parts_done
        if self.bar is not None:
            self.bar.update(parts_done)
            self.bar.set_postfix_str(self.text(), refresh=False)
        elif time.monotonic() - self.last_line > 30:
            self.last_line = time.monotonic()
            self.log(f"prepare: {self.done}/{self.total} parts, {self.text()}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# -- the job: plan, run, join, publish -----------------------------------------------------------------

def prepare(spec: PrepareSpec, out: Path, *, workers: int = 0, max_bad_fraction: float = 0.001,
            log: Callable[[str], None] = print, progress: bool | None = None) -> TokenStore:
    """Tokenise `spec` into the store `out` (see the module docstring); returns it opened.

    `out` that already holds the store of this spec is returned as it is; one of other inputs, or a
    folder that is not a store, is an error (nothing is overwritten). `workers` = 0: every core."""
    out = Path(out)
    key = spec.key()
    if (out / MANIFEST).is_file():
        store = TokenStore.open(out)
        if store.manifest.get("key") != key:
            raise ConfigError(f"{out} already holds a token store of other inputs or settings; pass another "
                              "OUT_DIR or remove that one")
        log(f"prepare: {out} is already prepared ({store.documents:,} documents, {store.n_tokens:,} tokens)")
        return store
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not a token store; pass a new or empty OUT_DIR")
    out.parent.mkdir(parents=True, exist_ok=True)
    def busy(lock: FileLock, h: dict) -> ConfigError:
        return ConfigError(f"another shardlm prepare ({h.get('host', '?')} pid {h.get('pid', '?')}) is writing "
                           f"{out}; wait for it to finish (a second run then finds the store), or pass another OUT_DIR")

    # two prepares of one OUT would share temp names
    lock = FileLock(out.parent / f".{out.name}.prepare.lock", log=log, heartbeat_s=LOCK_REFRESH_S,
                    stale_s=LOCK_STALE_S, busy=busy,
                    taken_over=lambda lock, why, h: f"prepare: took over {out} from a prepare that is gone")
    if not lock.acquire():
        raise busy(lock, lock.holder() or {})
    state: dict = {}
    try:
        if (out / MANIFEST).is_file():  # the one we waited on finished it
            return prepare(spec, out, workers=workers, max_bad_fraction=max_bad_fraction, log=log)
        return _prepare_locked(spec, out, key, workers=workers, max_bad_fraction=max_bad_fraction, log=log,
                               progress=progress, state=state)
    except OSError as e:
        work = partial_dir(out)
        shutil.rmtree(work / "store", ignore_errors=True)  # a half-joined store: rebuilt from the parts
        err = disk_error(e, out.parent, f"prepare {out}", needed=_store_estimate(state.get("jobs", [])),
                         after=f"the finished parts in {work} are kept: the same prepare continues from them")
        if err is None:
            raise
        raise err from None
    finally:
        lock.release()


def _store_estimate(jobs: list[UnitJob]) -> int | None:
    """Bytes a prepare of `jobs` needs on its disk: its parts (scaled from the bytes per input byte of the parts
    finished so far) and the store they are joined into. None before a part is finished."""
    finished = [j for j in jobs if j.done()]
    if not finished:
        return None
    written = sum(f.stat().st_size for j in finished for f in j.base.parent.glob(f"{j.base.name}.*"))
    done_in = sum(j.input_bytes() for j in finished)
    total_in = sum(j.input_bytes() for j in jobs)
    return int(2 * written * total_in / done_in) if written and done_in else None


def _prepare_locked(spec: PrepareSpec, out: Path, key: str, *, workers: int, max_bad_fraction: float,
                    log: Callable[[str], None], progress: bool | None, state: dict) -> TokenStore:
    """The prepare itself, under `out`'s prepare lock: plan the jobs, run those not done yet, join the parts
    into a staged store, publish it as `out` and say what it holds."""
    tok = load_tokenizer(spec.tokenizer)
    dtype = token_dtype(tok.vocab_size)
    work = _work_dir(spec, out, key, log)
    jobs = _plan_jobs(spec, work / "parts", dtype, tok.eos_id)
    state["jobs"] = jobs  # for the space estimate of a full disk
    todo = [j for j in jobs if not j.done()]
    if len(todo) < len(jobs):
        log(f"prepare: resuming {work}: {len(jobs) - len(todo)} of {len(jobs)} parts already done")
    t0 = time.monotonic()
    used = _run_jobs(spec, todo, len(jobs), workers, log, progress)
    stage, bad = _join(spec, jobs, work, key, tok, dtype, max_bad_fraction, log)
    swap_in(stage, out)  # an empty `out` (checked by `prepare`) is replaced
    shutil.rmtree(work, ignore_errors=True)
    store = TokenStore.open(out)
    _report(spec, store, out, time.monotonic() - t0, used, bad, log)
    return store


def _work_dir(spec: PrepareSpec, out: Path, key: str, log: Callable[[str], None]) -> Path:
    """`out`'s partial folder with its parts/ and spec.json: kept when it is this spec's (a rerun continues
    from its parts), removed first when it is an unfinished prepare of other inputs."""
    work = partial_dir(out)
    spec_file = work / "spec.json"
    if work.is_dir():
        try:
            same = json.loads(spec_file.read_text()).get("key") == key
        except (OSError, json.JSONDecodeError):
            same = False
        if not same:
            log(f"prepare: removing {work}, an unfinished prepare of other inputs")
            shutil.rmtree(work)
    (work / "parts").mkdir(parents=True, exist_ok=True)
    if not spec_file.is_file():
        spec_file.write_text(json.dumps({"key": key, **spec.to_dict()}, indent=1))
    return work


def _plan_jobs(spec: PrepareSpec, parts: Path, dtype: np.dtype, eos: int) -> list[UnitJob]:
    """The jobs of the training files (split by --val-fraction) then of the --val files, each in unit order."""
    jobs = []
    for split, files, fraction in (("train", spec.files, spec.val_fraction), ("val", spec.val_files, 0.0)):
        groups = _groups(plan_units(files, spec.chunk_bytes), spec.chunk_bytes // 8) if files else []
        jobs += [UnitJob(i, group, split, str(parts), spec.text_field, fraction, spec.seed, dtype.name, eos,
                         spec.kind) for i, group in enumerate(groups)]
    return jobs


def _run_jobs(spec: PrepareSpec, todo: list[UnitJob], n_jobs: int, workers: int, log: Callable[[str], None],
              progress: bool | None) -> int:
    """Run `todo` in this process or a pool of `workers` (0: every core; fewer for a small input), with a
    progress bar or line; returns the number of workers used."""
    by_size = -(-sum(j.input_bytes() for j in todo) // POOL_BYTES_PER_WORKER)  # small inputs: fewer processes
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1, by_size or 1))
    ctx = mp.get_context("spawn")
    in_process = workers == 1 or len(todo) <= 1
    # In process: plain counters. A shared Array holds a semaphore the resource tracker would report as
    # leaked when this process is killed later (a training rank that prepared its data).
    counters = _LocalCounters() if in_process else ctx.Array("q", 2)
    bar = _Progress(counters, n_jobs, n_jobs - len(todo), log, progress)
    init = (spec.tokenizer, counters, not in_process, spec.kind, spec.template_dir)
    try:
        if in_process:
            _run_in_process(todo, init, bar)
        else:
            with ctx.Pool(workers, initializer=_init_worker, initargs=init) as pool:
                results = pool.imap_unordered(_prepare_unit, todo)
                while True:
                    try:
                        results.next(timeout=1.0)
                        bar.update(1)
                    except mp.TimeoutError:
                        bar.update(0)
                    except StopIteration:
                        break
    finally:
        bar.close()
    return workers


def _run_in_process(todo: list[UnitJob], init: tuple, bar: _Progress) -> None:
    _init_worker(*init)
    try:
        for job in todo:
            _prepare_unit(job)
            bar.update(1)
    finally:
        _W.clear()  # the tokenizer and counters of this prepare: not kept for the life of the process


def _bad_records(jobs: list[UnitJob], log: Callable[[str], None] | None = None) -> BadRecords:
    """The jobs' bad records merged in order; with `log`, one line for the stdlib files that are not UTF-8."""
    bad, skipped = BadRecords(), []
    for job in jobs:
        info = json.loads(with_ext(job.base, ".json").read_text())
        bad.merge(BadRecords.from_dict(info["bad"]))
        skipped += [(Path(f), why) for f, why in info.get("stdlib_skipped", [])]
    if skipped and log is not None:
        log(skipped_line(skipped))
    return bad


def _join(spec: PrepareSpec, jobs: list[UnitJob], work: Path, key: str, tok: Tokenizer, dtype: np.dtype,
          max_bad_fraction: float, log: Callable[[str], None]) -> tuple[Path, BadRecords]:
    """The parts joined into work/store/ (and its val/: the --val files', or the .val parts of
    --val-fraction); returns it and the training files' bad records (checked against `max_bad_fraction`)."""
    stage = work / "store"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir()
    train = [j for j in jobs if j.split == "train"]
    bad = _bad_records(train, log)
    bad.check(max_bad_fraction)
    val = {"fraction": spec.val_fraction, "seed": spec.seed} if spec.val_fraction > 0 else \
        {"files": len(spec.val_files)} if spec.val_files else None  # what a missing val/ is checked against
    _assemble([j.base for j in train], stage, spec, key, tok, dtype, "train", bad, val)
    if spec.val_files:
        val_jobs = [j for j in jobs if j.split == "val"]
        val_bad = _bad_records(val_jobs)
        val_bad.check(max_bad_fraction)
        (stage / "val").mkdir()
        _assemble([j.base for j in val_jobs], stage / "val", spec, key, tok, dtype, "val", val_bad, None,
                  files=spec.val_files)
    elif val:
        (stage / "val").mkdir()
        _assemble([with_ext(j.base, ".val") for j in train], stage / "val", spec, key, tok, dtype, "val",
                  BadRecords(), val)
    return stage, bad


def _report(spec: PrepareSpec, store: TokenStore, out: Path, took: float, workers: int, bad: BadRecords,
            log: Callable[[str], None]) -> None:
    """The prepare's line (and its validation split's), the bad-records warning, and a warning when
    --val-fraction held out more than it left for training."""
    docs = "SFT samples" if spec.kind == "sft" else "documents"
    held_out = store.val()
    log(f"prepare: wrote {out}: {store.documents:,} {docs}, {store.n_tokens:,} tokens "
        f"({store.tokens.dtype.name}) in {took:.1f}s with {workers} worker{'s' if workers > 1 else ''}"
        + (f"; validation: {held_out.documents:,} {docs}, {held_out.n_tokens:,} tokens" if held_out is not None
           else ""))
    if line := bad.line():
        say(f"shardlm: warning: {line}")
    if spec.val_fraction > 0 and held_out is not None and held_out.documents > store.documents:
        print(f"shardlm: warning: --val-fraction {spec.val_fraction:g} left {store.documents:,} {docs} for training "
              f"and put {held_out.documents:,} in validation; a validation split is usually 0.001-0.05",
              file=sys.stderr, flush=True)


def _assemble(bases: list[Path], dest: Path, spec: PrepareSpec, key: str, tok: Tokenizer, dtype: np.dtype,
              split: str, bad: BadRecords, val: dict | None, files: list[Path] | None = None) -> None:
    """Join the parts `bases` in order into the store `dest` (`format.join_parts`), then write its manifest."""
    joined = join_parts(bases, dest, spec.kind == "sft")
    manifest = {
        "key": key, "split": split,
        "tokenizer": {**tok.ref.manifest_record(), "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
        "dtype": dtype.name, "documents": joined.documents, "tokens": joined.tokens, "text_field": spec.text_field,
        "sources": spec.sources(spec.files if files is None else files),
        "val": val,
        "bad_records": bad.to_dict(), "sha256": joined.sha256,
    }
    if spec.kind == "sft":
        manifest |= {"kind": "sft", "template": spec.template}
    write_manifest(dest, manifest)


# -- the data cache: raw files -> a store, once per shared filesystem ------------------------------------------

def ensure_cached_store(spec: PrepareSpec, cache_dir: Path, *, workers: int = 0, max_bad_fraction: float = 0.001,
                        log: Callable[[str], None] = print, wait_log: Callable[[str], None] | None = None,
                        poll_s: float = 0.5) -> TokenStore:
    """The store of `spec` in `cache_dir/<key>/` (`cache.cached_store`): opened when it is there, else
    prepared by whichever process takes the lock first while the others wait for it. `log` is for the
    preparing process's lines, `wait_log` (default `log`) for a waiting one's."""
    def build(out: Path) -> TokenStore:
        return prepare(spec, out, workers=workers, max_bad_fraction=max_bad_fraction, log=log)

    return cached_store(spec.key(), cache_dir, build, log=log, wait_log=wait_log, poll_s=poll_s)


def files_spec(data_path: str, tokenizer: Tokenizer, tokenizer_spec: str, text_field: str,
               kind: str = "text") -> PrepareSpec:
    """The PrepareSpec of training on the raw files of `data_path` (no validation split); kind "sft": the
    records rendered with the chat template of the tokenizer's folder."""
    if kind == "sft":
        return sft_spec(resolve_sources(data_path), tokenizer, tokenizer.directory, tokenizer_spec)
    return PrepareSpec(resolve_sources(data_path), tokenizer_spec, tokenizer.fingerprint, text_field)


def sft_spec(files: list[Path], tokenizer: Tokenizer, template_dir: str | Path | None,
             tokenizer_spec: str | None = None) -> PrepareSpec:
    """The PrepareSpec of SFT records in `files`, rendered with the chat template of `template_dir` (None, or a
    folder without one: the plain template)."""
    t = load_template(tokenizer, template_dir)
    return PrepareSpec(files, tokenizer_spec or tokenizer.spec, tokenizer.fingerprint, kind="sft",
                       template_dir=None if template_dir is None else str(template_dir),
                       template={"name": t.name, "fingerprint": t.fingerprint})


__all__ = ["MAX_CHUNK", "MIN_CHUNK", "PrepareSpec", "UnitJob", "auto_chunk_bytes", "ensure_cached_store",
           "files_spec", "in_val", "prepare", "sft_spec"]
