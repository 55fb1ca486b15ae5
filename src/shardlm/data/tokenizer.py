"""Tokenizers: UTF-8 bytes (no files needed) or any Hugging Face `tokenizer.json`."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from shardlm.errors import ConfigError, DataError

_EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "<|im_end|>", "</s>", "<eos>", "<|eot_id|>")
ENCODE_BATCH = 256  # texts per encode_batch call (HF tokenizers encode a batch on several threads)


class ByteTokenizer:
    """Each UTF-8 byte is a token; 256 is end-of-text."""

    vocab_size = 257
    eos_id = 256
    fingerprint = "bytes-v1"
    spec = "bytes"  # what load_tokenizer takes to make it again (e.g. in a worker process)
    directory = None  # no files (an HF tokenizer's folder holds its chat template and config)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` from tokenizer.json; EOS is the first known end token it has."""

    def __init__(self, path: Path):
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
        self.fingerprint = "hf-" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]
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
    if spec == "bytes":
        return ByteTokenizer()
    p = Path(spec)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ConfigError(f"data.tokenizer {spec!r}: no tokenizer.json there; pass `bytes` or a path to an HF tokenizer.json")
    return HFTokenizer(p)
