"""The token store: a corpus tokenised once, offline and in parallel, that every rank memory-maps.

A store is a directory:

    manifest.json   what it holds and how it was made (format, version, tokenizer fingerprint, dtype, sources
                    with size and mtime, documents, tokens, bad records, sha256 of the two files below)
    tokens.bin      every document's ids followed by EOS, back to back (uint16, or uint32 past 65,536 ids)
    docs.idx        int64 offsets: document d is tokens[idx[d] : idx[d + 1]] (documents + 1 entries)
    val/            (optional) the held-out validation store, same layout

A store of kind "sft" (`--data.format sft`) holds one SFT sample per document instead (a rendered, tokenised
conversation, `shardlm.data.chat`; no EOS added: the template has its own end markers), and two more files:

    mask.bin        one byte per token: 1 where the token is part of an answer (a loss target)
    answers.idx     int64 pairs per sample: first answer position >= 1 (0: none), answer tokens at positions >= 1

Its manifest also names the chat template (its fingerprint: the template shapes the ids and the masks).

`prepare()` builds one. The input is cut into units (`shardlm.data.sources.plan_units`: a row group, a record
batch, a byte range of a .jsonl, a file), each tokenised on its own by a pool of worker processes into
`<out>.partial/parts/`, then the parts are concatenated in unit order: the bytes do not depend on the number of
workers. A killed prepare keeps its finished parts and a rerun continues from them; the store appears (one
rename) only when complete, so a directory with a manifest is always whole. Memory is bounded by a batch of
documents per worker and a copy buffer, not by the corpus.

Training on raw files goes through the same code: `ensure_cached_store` prepares a store in the data cache
before the process group starts (no collective can time out meanwhile), once per shared filesystem: the first
process to take the cache's lock prepares, the others wait for its manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from shardlm.data.sources import BadRecords, Unit, is_stdlib, plan_units, read_texts, resolve_sources, skipped_line
from shardlm.data.tokenizer import Tokenizer, encode_texts, load_tokenizer
from shardlm.errors import ConfigError, DataError
from shardlm.fsutil import pid_alive, proc_start  # the run lock's liveness rule (pid + its start time)

FORMAT, VERSION = "shardlm-token-store", 1
MANIFEST, TOKENS, INDEX = "manifest.json", "tokens.bin", "docs.idx"
MASK, ANSWERS = "mask.bin", "answers.idx"  # kind "sft" only
STORE_PREFIX = "store:"
COPY_BYTES = 16 << 20


def default_cache_dir() -> Path:
    """Where data.path's files are prepared when data.cache_dir is unset (one store per content hash)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardlm" / "tokens"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def is_store(path: str | Path) -> bool:
    """`store:DIR`, or a directory holding a manifest.json."""
    s = str(path)
    return s.startswith(STORE_PREFIX) or (Path(s) / MANIFEST).is_file()


def store_path(spec: str) -> Path:
    return Path(spec[len(STORE_PREFIX):] if spec.startswith(STORE_PREFIX) else spec)


# -- reading -----------------------------------------------------------------------------------------------

@dataclass
class TokenStore:
    """An opened store: `tokens` and `starts` are read-only memory maps."""

    path: Path
    manifest: dict
    tokens: np.ndarray
    starts: np.ndarray  # documents + 1 offsets into tokens
    mask: np.ndarray | None = None  # kind "sft": uint8 per token, 1 on answer tokens
    answers: np.ndarray | None = None  # kind "sft": (documents, 2) int64, see the module docstring

    @property
    def kind(self) -> str:
        """"text" (documents, each ending in EOS) or "sft" (samples with answer masks)."""
        return self.manifest.get("kind", "text")

    @property
    def documents(self) -> int:
        return int(self.manifest["documents"])

    @property
    def n_tokens(self) -> int:
        return int(self.manifest["tokens"])

    def identity(self) -> dict:
        """What the samples are, for a checkpoint to compare on resume: the counts and one sha256 over the
        manifest's file checksums (the content, not the path or the files' times)."""
        sums = self.manifest.get("sha256") or {}
        digest = hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()[:16] if sums else None
        return {"documents": self.documents, "tokens": self.n_tokens, "sha256": digest}

    @classmethod
    def open(cls, path: str | Path) -> TokenStore:
        """Open and check a store: a missing or foreign manifest, a truncated or resized file is one line."""
        path = store_path(str(path))
        m_path = path / MANIFEST
        if not m_path.is_file():
            hint = " (a prepare of it is still running or was killed: rerun `shardlm prepare`)" \
                if _partial_dir(path).is_dir() else ""
            raise ConfigError(f"data.path {str(path)!r} is not a token store (no {MANIFEST}){hint}; "
                              "make one with `shardlm prepare SOURCE... OUT_DIR`")
        try:
            manifest = json.loads(m_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(f"{m_path}: unreadable manifest ({e}); prepare the store again") from None
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise DataError(f"{m_path}: not a shardlm token store of version {VERSION} (format "
                            f"{manifest.get('format')!r}, version {manifest.get('version')!r}); prepare it again "
                            "with this shardlm")
        dtype = np.dtype(manifest["dtype"])
        n_tok, n_docs = int(manifest["tokens"]), int(manifest["documents"])
        sft = manifest.get("kind", "text") == "sft"
        files = [(TOKENS, n_tok * dtype.itemsize), (INDEX, (n_docs + 1) * 8)]
        files += [(MASK, n_tok), (ANSWERS, n_docs * 16)] if sft else []
        for name, want in files:
            f = path / name
            have = f.stat().st_size if f.is_file() else None
            if have != want:
                what = "missing" if have is None else f"{have:,} bytes, the manifest says {want:,}"
                raise DataError(f"token store {path}: {name} is {what} (a copy cut short?); copy or prepare the "
                                "store again")
        tokens = np.memmap(path / TOKENS, dtype=dtype, mode="r") if n_tok else np.zeros(0, dtype)
        starts = np.memmap(path / INDEX, dtype=np.int64, mode="r")
        if not sft:
            return cls(path, manifest, tokens, starts)
        mask = np.memmap(path / MASK, dtype=np.uint8, mode="r") if n_tok else np.zeros(0, np.uint8)
        answers = np.memmap(path / ANSWERS, dtype=np.int64, mode="r", shape=(n_docs, 2)) if n_docs \
            else np.zeros((0, 2), np.int64)
        return cls(path, manifest, tokens, starts, mask, answers)

    def check_tokenizer(self, tokenizer: Tokenizer, what: str = "the model's tokenizer") -> None:
        """The store's ids must be the tokenizer's: one line naming both when they are not."""
        t = self.manifest["tokenizer"]
        if t["fingerprint"] != tokenizer.fingerprint:
            raise ConfigError(f"token store {self.path} was tokenised with {t['spec']} (fingerprint "
                              f"{t['fingerprint']}), but {what} is {tokenizer.fingerprint}: prepare the store "
                              "with the run's tokenizer (--data.tokenizer) or set data.tokenizer to the store's")

    def check_template(self, template, what: str = "the run's chat template") -> None:
        """An SFT store's samples were rendered with a template: it must be the run's (one line otherwise)."""
        t = self.manifest.get("template") or {}
        if t.get("fingerprint") != template.fingerprint:
            raise ConfigError(f"token store {self.path} was rendered with the {t.get('name', '?')} template "
                              f"({t.get('fingerprint')}), but {what} is {template.name} ({template.fingerprint}): "
                              "prepare the store again with the run's tokenizer folder (its chat template)")

    def verify(self) -> None:
        """Recompute the checksums (reads every byte)."""
        for name in self.manifest["sha256"]:
            if _sha256(self.path / name) != self.manifest["sha256"][name]:
                raise DataError(f"token store {self.path}: {name} does not match its checksum; the copy is "
                                "corrupt: copy or prepare the store again")

    def val(self) -> TokenStore | None:
        """The validation store `val/` prepared with it (--val-fraction or --val), or None when none was; one
        that was prepared but is gone or incomplete is a DataError."""
        if (self.path / "val" / MANIFEST).is_file():
            return TokenStore.open(self.path / "val")
        made = self.manifest.get("val")
        if made:
            how = f"--val-fraction {made['fraction']:g}" if "fraction" in made else "--val"
            raise DataError(f"{self.path} was prepared with {how}, but its validation store {self.path / 'val'} "
                            "is missing or incomplete; prepare the store again (the same command), or set "
                            "data.val_path, or eval.interval=0 and eval.at_end=false")
        return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(COPY_BYTES):
            h.update(chunk)
    return h.hexdigest()


# -- preparing ---------------------------------------------------------------------------------------------

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
            from shardlm.data.chat import load_template

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


def _partial_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def in_val(text: str, seed: int, fraction: float) -> bool:
    """A document's split, from its content and the seed only: the same on every machine, whatever the
    workers, the units or the order; duplicates land on the same side (no train/val leak through them)."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8,
                             key=seed.to_bytes(8, "little", signed=True)).digest()
    return int.from_bytes(digest, "little") < fraction * 2.0 ** 64


# Worker state (one per process of the pool, set by _init_worker)
_W: dict[str, Any] = {}


def _init_worker(tokenizer: str, counters: Any, pool: bool = True, kind: str = "text",
                 template_dir: str | None = None) -> None:
    if pool:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per core already
    _W["tok"], _W["counters"] = load_tokenizer(tokenizer), counters
    if kind == "sft":
        from shardlm.data.chat import load_template

        _W["template"] = load_template(_W["tok"], template_dir)


def _ext(base: Path, ext: str) -> Path:
    """base + ext (Path.with_suffix would eat a `.val` in the name)."""
    return base.with_name(base.name + ext)


class _Part:
    """One output (train or val) of one unit: ids appended to a .bin, document lengths collected; with `sft`,
    samples: ids (no EOS added) with their answer mask (.mask) and per-sample answer info (.ans)."""

    def __init__(self, path: Path, dtype: np.dtype, eos: int, sft: bool = False):
        self.path, self.dtype, self.sft = path, dtype, sft
        self.eos = np.array([eos], dtype=dtype).tobytes()
        self.f = open(_ext(path, ".bin.tmp"), "wb")
        self.m = open(_ext(path, ".mask.tmp"), "wb") if sft else None
        self.lengths: list[int] = []
        self.answers: list[tuple[int, int]] = []

    def add(self, ids: np.ndarray) -> None:
        self.f.write(ids.astype(self.dtype, copy=False).tobytes())
        self.f.write(self.eos)
        self.lengths.append(int(ids.size) + 1)

    def add_sample(self, ids: np.ndarray, mask: np.ndarray) -> None:
        from shardlm.data.chat import answer_info

        self.f.write(ids.astype(self.dtype, copy=False).tobytes())
        self.m.write(np.asarray(mask, dtype=np.uint8).tobytes())  # type: ignore[union-attr]
        self.lengths.append(int(ids.size))
        self.answers.append(answer_info(mask))

    def finish(self) -> dict:
        self.f.close()
        names = [".bin", ".len"]
        np.asarray(self.lengths, dtype=np.int64).tofile(_ext(self.path, ".len.tmp"))
        if self.m is not None:
            self.m.close()
            np.asarray(self.answers, dtype=np.int64).reshape(-1, 2).tofile(_ext(self.path, ".ans.tmp"))
            names += [".mask", ".ans"]
        for ext in names:
            os.replace(_ext(self.path, ext + ".tmp"), _ext(self.path, ext))
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


def _prepare_unit(job: tuple[int, list[Unit], str, str, str, float, int, str, int, str]) -> dict:
    """Tokenise one group of units into parts/<split>-<i>.{bin,len} (+ .val.*; sft: + .mask, .ans); its .json,
    written last, marks it done."""
    i, units, split, parts, text_field, val_fraction, seed, dtype_name, eos, kind = job
    tok, counters = _W["tok"], _W.get("counters")
    dtype, base = np.dtype(dtype_name), Path(parts) / f"{split}-{i:06d}"
    bad = BadRecords()
    sft = kind == "sft"
    train = _Part(base, dtype, eos, sft)
    val = _Part(base.with_name(base.name + ".val"), dtype, eos, sft) if val_fraction > 0 else None
    pending = [0, 0]
    if sft:
        _sft_unit(units, tok, _W["template"], train, val, seed, val_fraction, bad, counters, pending)
        return _finish_unit(i, base, train, val, bad, [], counters, pending)

    stdlib_skipped: list[tuple[str, str]] = []

    def texts() -> Iterator[str]:
        for unit in units:
            got = BadRecords()
            for text in read_texts(unit, text_field, got):
                if text:
                    yield text
            if got.bad and is_stdlib(unit.path):  # a few of its test files are not UTF-8 on purpose
                stdlib_skipped.append((unit.path, got.examples[0]))
            else:
                bad.merge(got)

    buffered: list[str] = []
    for text in texts():
        buffered.append(text)
        if len(buffered) >= 256:
            _encode_into(tok, buffered, train, val, seed, val_fraction, counters, pending)
            buffered = []
    if buffered:
        _encode_into(tok, buffered, train, val, seed, val_fraction, counters, pending)
    return _finish_unit(i, base, train, val, bad, stdlib_skipped, counters, pending)


def _sft_unit(units: list[Unit], tok: Tokenizer, template: Any, train: _Part, val: _Part | None, seed: int,
              fraction: float, bad: BadRecords, counters: Any, pending: list[int]) -> None:
    """SFT records -> rendered, tokenised samples (ids + answer mask), 256 records at a time."""
    from shardlm.data.chat import record_key, tokenize_records, unit_messages

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
    tmp = _ext(base, ".json.tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, _ext(base, ".json"))
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
    lock = _Lock(out.parent / f".{out.name}.prepare.lock")  # two prepares of one OUT would share temp names
    if not lock.try_acquire():
        if lock.remove_if_stale():
            log(f"prepare: took over {out} from a prepare that is gone")
        if not lock.try_acquire():
            h = lock.holder() or {}
            raise ConfigError(f"another shardlm prepare ({h.get('host', '?')} pid {h.get('pid', '?')}) is writing "
                              f"{out}; wait for it to finish (a second run then finds the store), or pass another "
                              "OUT_DIR")
    state: dict = {}
    try:
        if (out / MANIFEST).is_file():  # the one we waited on finished it
            return prepare(spec, out, workers=workers, max_bad_fraction=max_bad_fraction, log=log)
        return _prepare_locked(spec, out, key, workers=workers, max_bad_fraction=max_bad_fraction, log=log,
                               progress=progress, state=state)
    except OSError as e:
        from shardlm.disk import disk_error

        work = _partial_dir(out)
        shutil.rmtree(work / "store", ignore_errors=True)  # a half-joined store: rebuilt from the parts
        err = disk_error(e, out.parent, f"prepare {out}", needed=_store_estimate(work, state.get("jobs", [])),
                         after=f"the finished parts in {work} are kept: the same prepare continues from them")
        if err is None:
            raise
        raise err from None
    finally:
        lock.release()


def _store_estimate(work: Path, jobs: list) -> int | None:
    """Bytes a prepare of `jobs` needs on its disk: its parts (scaled from the bytes per input byte of the parts
    finished so far) and the store they are joined into. None before a part is finished."""
    parts = work / "parts"
    if not parts.is_dir():
        return None
    finished = [j for j in jobs if (parts / f"{j[2]}-{j[0]:06d}.json").is_file()]
    written = sum(f.stat().st_size for j in finished for f in parts.glob(f"{j[2]}-{j[0]:06d}.*"))
    done_in = sum(_unit_bytes(u) for j in finished for u in j[1])
    total_in = sum(_unit_bytes(u) for j in jobs for u in j[1])
    return int(2 * written * total_in / done_in) if written and done_in else None


def _prepare_locked(spec: PrepareSpec, out: Path, key: str, *, workers: int, max_bad_fraction: float,
                    log: Callable[[str], None], progress: bool | None, state: dict) -> TokenStore:
    tok = load_tokenizer(spec.tokenizer)
    dtype = token_dtype(tok.vocab_size)
    work = _partial_dir(out)
    parts = work / "parts"
    spec_file = work / "spec.json"
    if work.is_dir():
        try:
            same = json.loads(spec_file.read_text()).get("key") == key
        except (OSError, json.JSONDecodeError):
            same = False
        if not same:
            log(f"prepare: removing {work}, an unfinished prepare of other inputs")
            shutil.rmtree(work)
    parts.mkdir(parents=True, exist_ok=True)
    if not spec_file.is_file():
        spec_file.write_text(json.dumps({"key": key, **spec.to_dict()}, indent=1))

    jobs = []
    for split, files, fraction in (("train", spec.files, spec.val_fraction), ("val", spec.val_files, 0.0)):
        for i, group in enumerate(_groups(plan_units(files, spec.chunk_bytes), spec.chunk_bytes // 8) if files else []):
            jobs.append((i, group, split, str(parts), spec.text_field, fraction, spec.seed, dtype.name, tok.eos_id,
                         spec.kind))
    done = {(j[2], j[0]) for j in jobs if (parts / f"{j[2]}-{j[0]:06d}.json").is_file()}
    todo = [j for j in jobs if (j[2], j[0]) not in done]
    if done:
        log(f"prepare: resuming {work}: {len(done)} of {len(jobs)} parts already done")
    state["jobs"] = jobs  # for the space estimate of a full disk
    todo_bytes = sum(_unit_bytes(u) for j in todo for u in j[1])
    by_size = -(-todo_bytes // POOL_BYTES_PER_WORKER)  # small inputs: fewer processes (1 = no pool at all)
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1, by_size or 1))
    ctx = mp.get_context("spawn")
    in_process = workers == 1 or len(todo) <= 1
    # In process: plain counters. A shared Array holds a semaphore the resource tracker would report as
    # leaked when this process is killed later (a training rank that prepared its data).
    counters = _LocalCounters() if in_process else ctx.Array("q", 2)
    t0 = time.monotonic()
    bar = _Progress(counters, len(jobs), len(done), log, progress)
    try:
        if in_process:
            _init_worker(spec.tokenizer, counters, False, spec.kind, spec.template_dir)
            try:
                for job in todo:
                    _prepare_unit(job)
                    bar.update(1)
            finally:
                _W.clear()  # the tokenizer and counters of this prepare: not kept for the life of the process
        else:
            with ctx.Pool(workers, initializer=_init_worker, initargs=(spec.tokenizer, counters, True, spec.kind, spec.template_dir)) as pool:
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
    stage = work / "store"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir()
    n_train, n_val = (sum(1 for j in jobs if j[2] == split) for split in ("train", "val"))
    bad, skipped = BadRecords(), []
    for i in range(n_train):
        info = json.loads((parts / f"train-{i:06d}.json").read_text())
        bad.merge(BadRecords.from_dict(info["bad"]))
        skipped += [(Path(f), why) for f, why in info.get("stdlib_skipped", [])]
    if skipped:
        log(skipped_line(skipped))
    bad.check(max_bad_fraction)
    val = {"fraction": spec.val_fraction, "seed": spec.seed} if spec.val_fraction > 0 else \
        {"files": len(spec.val_files)} if spec.val_files else None  # what a missing val/ is checked against
    _assemble([parts / f"train-{i:06d}" for i in range(n_train)], stage, spec, key, tok, dtype, "train", bad, val)
    if spec.val_files:
        val_bad = BadRecords()
        for i in range(n_val):
            val_bad.merge(BadRecords.from_dict(json.loads((parts / f"val-{i:06d}.json").read_text())["bad"]))
        val_bad.check(max_bad_fraction)
        (stage / "val").mkdir()
        _assemble([parts / f"val-{i:06d}" for i in range(n_val)], stage / "val", spec, key, tok, dtype, "val",
                  val_bad, None, files=spec.val_files)
    elif val:
        (stage / "val").mkdir()
        _assemble([parts / f"train-{i:06d}.val" for i in range(n_train)], stage / "val", spec, key, tok, dtype,
                  "val", BadRecords(), val)
    if out.is_dir():
        out.rmdir()  # empty (checked above)
    os.replace(stage, out)
    shutil.rmtree(work, ignore_errors=True)
    store = TokenStore.open(out)
    took = time.monotonic() - t0
    docs = "SFT samples" if spec.kind == "sft" else "documents"
    log(f"prepare: wrote {out}: {store.documents:,} {docs}, {store.n_tokens:,} tokens "
        f"({store.tokens.dtype.name}) in {took:.1f}s with {workers} worker{'s' if workers > 1 else ''}"
        + (f"; validation: {store.val().documents:,} {docs}, {store.val().n_tokens:,} tokens"  # type: ignore[union-attr]
           if store.val() is not None else ""))
    if line := bad.line():
        print(f"shardlm: warning: {line}", file=sys.stderr, flush=True)
    held_out = store.val()
    if spec.val_fraction > 0 and held_out is not None and held_out.documents > store.documents:
        print(f"shardlm: warning: --val-fraction {spec.val_fraction:g} left {store.documents:,} {docs} for training "
              f"and put {held_out.documents:,} in validation; a validation split is usually 0.001-0.05",
              file=sys.stderr, flush=True)
    return store


def _assemble(bases: list[Path], dest: Path, spec: PrepareSpec, key: str, tok: Tokenizer, dtype: np.dtype,
              split: str, bad: BadRecords, val: dict | None, files: list[Path] | None = None) -> None:
    """Concatenate the parts `bases` (<base>.bin, <base>.len) in order into dest/{tokens.bin,docs.idx}, then
    write its manifest."""
    sft = spec.kind == "sft"
    copied = [(TOKENS, ".bin"), *([(MASK, ".mask"), (ANSWERS, ".ans")] if sft else [])]  # parts joined as they are
    hashes = {name: hashlib.sha256() for name in [TOKENS, INDEX] + [n for n, _ in copied[1:]]}
    outs = {name: open(dest / name, "wb") for name in hashes}
    n_docs = n_tok = 0

    def put(name: str, data: bytes) -> None:
        outs[name].write(data)
        hashes[name].update(data)

    try:
        put(INDEX, np.zeros(1, np.int64).tobytes())
        for base in bases:
            for name, ext in copied:
                with open(_ext(base, ext), "rb") as f:
                    while chunk := f.read(COPY_BYTES):
                        put(name, chunk)
            lengths = np.fromfile(_ext(base, ".len"), dtype=np.int64)
            put(INDEX, (np.cumsum(lengths) + n_tok).astype(np.int64).tobytes())
            n_docs += lengths.size
            n_tok += int(lengths.sum())
        for f in outs.values():
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in outs.values():
            f.close()
    manifest = {
        "format": FORMAT, "version": VERSION, "key": key, "split": split,
        "tokenizer": {**tok.ref.manifest_record(), "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
        "dtype": dtype.name, "documents": n_docs, "tokens": n_tok, "text_field": spec.text_field,
        "sources": spec.sources(spec.files if files is None else files),
        "val": val,
        "bad_records": bad.to_dict(), "sha256": {name: h.hexdigest() for name, h in hashes.items()},
    }
    if sft:
        manifest |= {"kind": "sft", "template": spec.template}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


# -- the cache: raw files -> a store, once per shared filesystem -------------------------------------------

LOCK_STALE_S = 120.0  # a lock from another host untouched this long is a dead preparer's
LOCK_REFRESH_S = 10.0


def _host() -> str:
    return socket.gethostname()


class _Lock:
    """`<cache>/<key>.lock` made with O_EXCL: who prepares. The holder touches it every LOCK_REFRESH_S."""

    def __init__(self, path: Path):
        self.path = path
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def try_acquire(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"host": _host(), "pid": os.getpid(), "pid_start": proc_start(os.getpid())}))
        self._thread = threading.Thread(target=self._refresh, name="shardlm-store-lock", daemon=True)
        self._thread.start()
        return True

    def _refresh(self) -> None:
        while not self._stop.wait(LOCK_REFRESH_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.path.unlink(missing_ok=True)

    def holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text()) | {"age": time.time() - self.path.stat().st_mtime}
        except (OSError, json.JSONDecodeError):
            return None

    def remove_if_stale(self) -> bool:
        h = self.holder()
        if h is None:
            return False
        if h.get("host") == _host():
            if not isinstance(h.get("pid"), int) or pid_alive(h["pid"], h.get("pid_start")):  # pid reuse: start time
                return False
        elif h["age"] < LOCK_STALE_S:
            return False
        self.path.unlink(missing_ok=True)
        return True


def ensure_cached_store(spec: PrepareSpec, cache_dir: Path, *, workers: int = 0, max_bad_fraction: float = 0.001,
                        log: Callable[[str], None] = print, wait_log: Callable[[str], None] | None = None,
                        poll_s: float = 0.5) -> TokenStore:
    """The store of `spec` in `cache_dir/<key>/`: opened when it is there, else prepared by whichever process
    takes the lock first while the others wait for it (no timeout: a stale lock is taken over). `log` is for
    the preparing process's lines, `wait_log` (default `log`) for a waiting one's."""
    wait_log = log if wait_log is None else wait_log
    cache_dir.mkdir(parents=True, exist_ok=True)
    if removed := remove_abandoned(cache_dir, keep=spec.key()):
        log(f"data cache: removed {removed} unfinished preparation{'s' if removed > 1 else ''} of other inputs "
            f"untouched for a day in {cache_dir}")
    out = cache_dir / spec.key()
    lock = _Lock(cache_dir / f"{spec.key()}.lock")
    said = False
    while not (out / MANIFEST).is_file():
        if lock.try_acquire():
            try:
                if not (out / MANIFEST).is_file():
                    return prepare(spec, out, workers=workers, max_bad_fraction=max_bad_fraction, log=log)
            finally:
                lock.release()
            break
        if lock.remove_if_stale():
            wait_log(f"data: took over the preparation of {out} from a process that is gone")
            continue
        if not said:
            h = lock.holder() or {}
            wait_log(f"data: waiting for {h.get('host', '?')} pid {h.get('pid', '?')} to prepare {out}")
            said = True
        time.sleep(poll_s)
    return TokenStore.open(out)


PARTIAL_STALE_S = 24 * 3600


def remove_abandoned(cache_dir: Path, keep: str) -> int:
    """Remove the unfinished preparations (`.<key>.partial/`) in the cache that nobody holds the lock of and
    nobody wrote to for PARTIAL_STALE_S (inputs that changed since: their parts would never be used); the
    one of `keep` stays (a rerun continues it). Returns how many."""
    removed, now = 0, time.time()
    for work in cache_dir.glob(".*.partial"):
        key = work.name[1:-len(".partial")]
        if key == keep or (cache_dir / f"{key}.lock").exists():
            continue
        try:
            newest = max([work.stat().st_mtime, *(f.stat().st_mtime for f in work.rglob("*"))])
        except FileNotFoundError:  # someone else is removing or publishing it
            continue
        if now - newest > PARTIAL_STALE_S:
            shutil.rmtree(work, ignore_errors=True)
            removed += 1
    return removed


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
    from shardlm.data.chat import load_template

    t = load_template(tokenizer, template_dir)
    return PrepareSpec(files, tokenizer_spec or tokenizer.spec, tokenizer.fingerprint, kind="sft",
                       template_dir=None if template_dir is None else str(template_dir),
                       template={"name": t.name, "fingerprint": t.fingerprint})


__all__ = ["FORMAT", "MANIFEST", "PrepareSpec", "auto_chunk_bytes", "STORE_PREFIX", "TokenStore", "VERSION", "ensure_cached_store",
           "files_spec", "in_val", "is_store", "prepare", "sft_spec", "store_path", "token_dtype"]
