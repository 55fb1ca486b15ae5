"""Tokenizers: UTF-8 bytes (no files needed) or any Hugging Face `tokenizer.json`; `TokenizerRef`, the one
record of which tokenizer it is, that token stores (their manifest) and checkpoints (checkpoint.json, the
sidecar) record."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from shardlm.errors import ConfigError, DataError

BYTES = "bytes"  # the spec of the byte tokenizer
_EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "<|im_end|>", "</s>", "<eos>", "<|eot_id|>")
ENCODE_BATCH = 256  # texts per encode_batch call (HF tokenizers encode a batch on several threads)


def canonical_spec(spec: str) -> str:
    """A tokenizer spec as records keep it: "bytes", or the absolute path given (a tokenizer.json or its folder)."""
    return spec if spec == BYTES else str(Path(spec).resolve())


def tokenizer_file(spec: str) -> Path:
    """The tokenizer.json a spec names (the spec itself, or the one in the folder it names)."""
    p = Path(spec)
    return p / "tokenizer.json" if p.is_dir() else p


@dataclass(frozen=True)
class TokenizerRef:
    """Which tokenizer: its spec and the sha256 of its tokenizer.json ("bytes" for the byte tokenizer,
    "unreadable" when the file could not be read). Token stores and checkpoints record it alike; its
    `fingerprint` is what a store's ids are checked against."""

    spec: str  # canonical_spec: "bytes" or an absolute path (a tokenizer.json or its folder)
    sha256: str

    @classmethod
    def of(cls, spec: str, content: bytes | None = None) -> TokenizerRef:
        """The ref of `spec`; `content`: its tokenizer.json's bytes when the caller has read them already."""
        if spec == BYTES:
            return BYTES_REF
        if content is None:
            try:
                content = tokenizer_file(spec).read_bytes()
            except OSError:
                return cls(canonical_spec(spec), "unreadable")
        return cls(canonical_spec(spec), hashlib.sha256(content).hexdigest())

    @classmethod
    def from_record(cls, record: dict) -> TokenizerRef:
        """The ref a recorded `tokenizer` (checkpoint.json's, a manifest's) names, its spec as written."""
        return cls(record.get("spec"), record.get("sha256"))

    def same_as(self, other: TokenizerRef) -> bool:
        """Whether both are one tokenizer: the same tokenizer.json content (where it lies may differ)."""
        return self.sha256 == other.sha256

    @property
    def fingerprint(self) -> str:
        """"bytes-v1", or "hf-" + the first 16 hex digits of the sha256 (a store manifest's `fingerprint`)."""
        return "bytes-v1" if self.spec == BYTES else "hf-" + self.sha256[:16]

    @property
    def folder(self) -> Path | None:
        """The folder holding the tokenizer's files (chat template, config); None for the byte tokenizer."""
        return None if self.spec == BYTES else tokenizer_file(self.spec).parent

    def checkpoint_record(self) -> dict[str, str]:
        """checkpoint.json's `tokenizer`: {"spec": the tokenizer.json's absolute path ("bytes"), "sha256"}."""
        spec = self.spec if self.spec == BYTES else str(tokenizer_file(self.spec).resolve())
        return {"spec": spec, "sha256": self.sha256}

    def manifest_record(self) -> dict[str, str]:
        """A token store manifest's `tokenizer` (without the vocabulary facts): {"spec", "fingerprint", "sha256"}
        (sha256 since this record existed: older manifests lack it, nothing requires it)."""
        return {"spec": self.spec, "fingerprint": self.fingerprint, "sha256": self.sha256}


BYTES_REF = TokenizerRef(BYTES, BYTES)


class ByteTokenizer:
    """Each UTF-8 byte is a token; 256 is end-of-text."""

    vocab_size = 257
    eos_id = 256
    ref = BYTES_REF
    fingerprint = BYTES_REF.fingerprint
    spec = BYTES  # what load_tokenizer takes to make it again (e.g. in a worker process)
    directory = None  # no files (an HF tokenizer's folder holds its chat template and config)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` from tokenizer.json; EOS is the first known end token it has."""

    def __init__(self, path: Path, spec: str | None = None):
        """`spec`: what names it (the file, or its folder; default `path`): its `ref` records that."""
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise DataError(f"cannot read tokenizer {str(path)!r}: {e}") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        vocab = self.tok.get_vocab(with_added_tokens=True)
        eos = next((vocab[t] for t in _EOS_CANDIDATES if t in vocab), None)
        if eos is None:
            raise DataError(f"tokenizer {str(path)!r} has none of the end-of-text tokens {', '.join(_EOS_CANDIDATES)}")
        self.eos_id = eos
        self.ref = TokenizerRef.of(str(path) if spec is None else spec, path.read_bytes())
        self.fingerprint = self.ref.fingerprint
        self.spec = str(path)
        self.directory = path.parent  # tokenizer_config.json (chat template) and friends live here

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


Tokenizer = ByteTokenizer | HFTokenizer


def _encode_arrays(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    if isinstance(tokenizer, ByteTokenizer):  # the bytes are the ids: no copy through Python ints
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    if hasattr(tokenizer, "encode_batch"):
        return [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(texts)]
    return [np.asarray(tokenizer.encode(t), dtype=np.int64) for t in texts]


def encode_texts(tokenizer: Tokenizer, texts: Iterable[str]) -> Iterator[np.ndarray]:
    """Each text's ids (no special tokens added), in order, encoded ENCODE_BATCH texts at a time.

    Lazy: it reads at most ENCODE_BATCH texts ahead of what it has yielded. The arrays are uint8
    (bytes) or int64; an empty text gives an empty array.
    """
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == ENCODE_BATCH:
            yield from _encode_arrays(tokenizer, batch)
            batch = []
    if batch:
        yield from _encode_arrays(tokenizer, batch)


def load_tokenizer(spec: str) -> Tokenizer:
    """`bytes`, a tokenizer.json, or a directory holding one."""
    if spec == BYTES:
        return ByteTokenizer()
    p = tokenizer_file(spec)
    if not p.is_file():
        raise ConfigError(f"data.tokenizer {spec!r}: no tokenizer.json there; pass `bytes` or a path to an HF tokenizer.json")
    return HFTokenizer(p, spec)
