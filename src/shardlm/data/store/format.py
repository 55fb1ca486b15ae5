"""The token store on disk: its files, its manifest and checksums; opening one (`TokenStore`), writing one
from prepared parts (`join_parts`, `write_manifest`).

A store is a directory:

    manifest.json   what it holds and how it was made (format, version, tokenizer (`TokenizerRef`'s spec and
                    fingerprint, vocab_size, eos_id), dtype, sources with size and mtime, documents, tokens,
                    bad records, sha256 of the two files below)
    tokens.bin      every document's ids followed by EOS, back to back (uint16, or uint32 past 65,536 ids)
    docs.idx        int64 offsets: document d is tokens[idx[d] : idx[d + 1]] (documents + 1 entries)
    val/            (optional) the held-out validation store, same layout

A store of kind "sft" (`--data.format sft`) holds one SFT sample per document instead (a rendered, tokenised
conversation, `shardlm.data.chat`; no EOS added: the template has its own end markers), and two more files:

    mask.bin        one byte per token: 1 where the token is part of an answer (a loss target)
    answers.idx     int64 pairs per sample: first answer position >= 1 (0: none), answer tokens at positions >= 1

Its manifest also names the chat template (its fingerprint: the template shapes the ids and the masks).

A store is made by `shardlm.data.store.prepare` in `.<name>.partial/` beside it (`partial_dir`) and appears
with one rename when complete, so a directory with a manifest is always whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardlm.data.tokenizer import Tokenizer
from shardlm.errors import ConfigError, DataError

FORMAT, VERSION = "shardlm-token-store", 1
MANIFEST, TOKENS, INDEX = "manifest.json", "tokens.bin", "docs.idx"
MASK, ANSWERS = "mask.bin", "answers.idx"  # kind "sft" only
STORE_PREFIX = "store:"
COPY_BYTES = 16 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def is_store(path: str | Path) -> bool:
    """`store:DIR`, or a directory holding a manifest.json."""
    s = str(path)
    return s.startswith(STORE_PREFIX) or (Path(s) / MANIFEST).is_file()


def store_path(spec: str) -> Path:
    return Path(spec[len(STORE_PREFIX):] if spec.startswith(STORE_PREFIX) else spec)


def partial_dir(out: Path) -> Path:
    """Where the store `out` is prepared until it is complete."""
    return out.parent / f".{out.name}.partial"


def with_ext(base: Path, ext: str) -> Path:
    """base + ext (Path.with_suffix would eat a `.val` in the name)."""
    return base.with_name(base.name + ext)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(COPY_BYTES):
            h.update(chunk)
    return h.hexdigest()


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
                if partial_dir(path).is_dir() else ""
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
            if file_sha256(self.path / name) != self.manifest["sha256"][name]:
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



# -- writing -----------------------------------------------------------------------------------------------

@dataclass
class Joined:
    """What `join_parts` wrote: the counts and each file's sha256 (the manifest records them)."""

    documents: int
    tokens: int
    sha256: dict[str, str]


def join_parts(bases: list[Path], dest: Path, sft: bool) -> Joined:
    """Concatenate the parts `bases` (<base>.bin, <base>.len; sft: + <base>.mask, <base>.ans) in order into
    dest/{tokens.bin, docs.idx} (sft: + mask.bin, answers.idx), fsynced; bounded memory (COPY_BYTES)."""
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
                with open(with_ext(base, ext), "rb") as f:
                    while chunk := f.read(COPY_BYTES):
                        put(name, chunk)
            lengths = np.fromfile(with_ext(base, ".len"), dtype=np.int64)
            put(INDEX, (np.cumsum(lengths) + n_tok).astype(np.int64).tobytes())
            n_docs += lengths.size
            n_tok += int(lengths.sum())
        for f in outs.values():
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in outs.values():
            f.close()
    return Joined(n_docs, n_tok, {name: h.hexdigest() for name, h in hashes.items()})


def write_manifest(dest: Path, manifest: dict) -> None:
    """dest/manifest.json with the format and version added (written last: it marks the store whole)."""
    manifest = {"format": FORMAT, "version": VERSION, **manifest}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


__all__ = ["ANSWERS", "FORMAT", "INDEX", "MANIFEST", "MASK", "STORE_PREFIX", "TOKENS", "TokenStore", "VERSION",
           "file_sha256", "is_store", "join_parts", "partial_dir", "store_path", "token_dtype", "write_manifest"]
