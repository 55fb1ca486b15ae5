"""Supervised fine-tuning data: JSONL conversations -> token ids + a loss mask -> per-dp-rank micro-batches.

Records (one JSON object per line of a .jsonl file; the shape is detected per record):

  chat        {"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}
  completion  {"prompt": str, "completion": str}
  alpaca      {"instruction": str, "input": str (optional), "output": str}

A completion record becomes [user: prompt, assistant: completion]; an alpaca record becomes
[user: instruction (+ "\\n\\n" + input when input is non-empty), assistant: output].

Rendering. With a chat template (the tokenizer directory's `chat_template.jinja`, else the
`chat_template` of its `tokenizer_config.json`, as Hugging Face saves them) the conversation is
rendered with jinja2 the way `transformers` does it: an ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True) with loop controls, `raise_exception`, a `tojson` filter, `strftime_now`, a
pass-through `{% generation %}` tag, and the variables `messages`, `add_generation_prompt` (false)
plus every `*_token` string of tokenizer_config.json (`bos_token`, `eos_token`, ...). Without one,
the plain template is used (EOS is the tokenizer's end-of-text id, not text):

  ### System:\\n{system}\\n\\n        (one block per system message)
  ### User:\\n{user}\\n\\n
  ### Assistant:\\n{assistant}<EOS>

Loss masking (labels are IGNORE_INDEX except on what the model has to generate):
  1. The rendered text T is split into character spans: for assistant message i, the span starts
     where `render(messages[:i], add_generation_prompt=True)` ends (the exact prompt the model sees at
     inference) and ends where `render(messages[:i+1])` ends, trailing whitespace dropped, so it holds
     the content and the template's end-of-turn marker (`<|im_end|>`, `<|eot_id|>`, `</s>`, ...).
     This is used only when both renders are prefixes of T (true of ordinary templates). Otherwise
     (templates that render the last turn differently, or refuse a partial conversation) the content
     (or its strip()) is searched in T after the previous span, and the span is extended over an
     end-of-text token string that immediately follows it. A template that does not render an
     assistant message verbatim is an error naming the record.
  2. Each span and each text between spans is tokenised *separately* (no special tokens added) and
     the ids are concatenated. So no token ever straddles a prompt/answer boundary, the prompt of
     the first answer is tokenised exactly as it is at inference, and the loss tokens of an answer
     are exactly `encode(content + end marker)` (plain template: `encode(content) + [eos]`).
  3. A sample of n tokens gives n - 1 (input, label) pairs: inputs = ids[:-1], label[t] = ids[t+1]
     where token t+1 is an answer token, else IGNORE_INDEX. A sample's first token is never a target.

Samples longer than seq_len + 1 tokens are cut to seq_len + 1 (the end of the answer is lost; they
are counted in `truncated`); a sample left with no target token is dropped (counted in `dropped`).

Batching. `pack=True`: the (input, label) pairs of whole samples are placed into rows of seq_len by
best-fit decreasing (deterministic; a sample is never split over rows) and the rest of a row is
padding (input = pad id, label = IGNORE_INDEX). Each sample keeps its own labels, so no label ever
predicts another sample's token (a sample's last token, its EOS, is only ever a label: nothing in a row
predicts the next sample's first token). Attention is not blocked between samples of a row unless
`document_mask=True`: then `rows()` also returns positions, restarting at 0 at each sample and at the
padding (one more "document"), and the model attends within each sample only (see
`shardlm.data.packing`). `pack=False`: one sample per row, padded. Rows are then dealt by the same
`SampleOrder` as PackedLoader's windows: step s uses global rows [s*G, (s+1)*G) of a seeded per-epoch
permutation, micro-batch k of dp rank r holds rows k*mbs*dp + r*mbs ... +mbs; the only state is
`samples_seen`, so a resume on any dp degree continues where the run stopped.
"""

from __future__ import annotations

import itertools
import json
import sys
from bisect import bisect_left, insort
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from shardlm.data.order import IGNORE_INDEX, RowLoader, SampleOrder
from shardlm.data.readers import BadRecords, plan_units, read_records
from shardlm.data.tokenizer import _EOS_CANDIDATES, encode_texts
from shardlm.errors import ConfigError, DataError

ROLES = ("system", "user", "assistant")
SHAPES = ('{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}, '
          '{"prompt": str, "completion": str}, or {"instruction": str, "input": str (optional), "output": str}')

Message = dict[str, str]
Segment = tuple[Any, bool]  # (text, or a literal token id, is-loss)


# -- records ---------------------------------------------------------------------------------------
def record_to_messages(record: Any, where: str) -> list[Message]:
    """One JSONL record (any of the three shapes) as a list of {"role", "content"} messages."""
    def bad(why: str) -> DataError:
        return DataError(f"{where}: {why}; an SFT record is one of {SHAPES}")

    if not isinstance(record, dict):
        raise bad("not a JSON object")
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise bad('"messages" must be a non-empty list')
        out = []
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise bad(f'messages[{j}] must be {{"role": "system"|"user"|"assistant", "content": str}}')
            out.append({"role": m["role"], "content": m["content"]})
        if not any(m["role"] == "assistant" for m in out):
            raise bad('"messages" has no assistant turn, so nothing to learn')
        return out
    if "prompt" in record or "completion" in record:
        p, c = record.get("prompt"), record.get("completion")
        if not isinstance(p, str) or not isinstance(c, str):
            raise bad('"prompt" and "completion" must both be strings')
        return [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
    if "instruction" in record or "output" in record:
        ins, inp, outp = record.get("instruction"), record.get("input", ""), record.get("output")
        if not isinstance(ins, str) or not isinstance(outp, str) or not isinstance(inp, (str, type(None))):
            raise bad('"instruction" and "output" must be strings ("input" optional, a string)')
        user = f"{ins}\n\n{inp}" if inp else ins
        return [{"role": "user", "content": user}, {"role": "assistant", "content": outp}]
    raise bad(f"no known fields (has {', '.join(map(repr, sorted(record))) or 'none'})")


def iter_records(files: Sequence[Path], max_bad_fraction: float = 0.001) -> Iterator[tuple[list[Message], str]]:
    """(messages, location) for every record of the files (.jsonl(.gz/.zst), .parquet, .arrow, HF datasets
    folders: `shardlm.data.readers`), in order. A record that is not JSON, not an object or of no known shape
    is skipped and counted with its location; past `max_bad_fraction` of them, a DataError naming the first."""
    bad = BadRecords()
    for unit in plan_units([Path(f) for f in files]):
        for record, where in read_records(unit, bad):
            try:
                messages = record_to_messages(record, where)
            except DataError as e:
                reason, _, detail = str(e).removeprefix(f"{where}: ").partition("; ")
                bad.add_bad(where, reason, detail)
                bad.total -= 1  # read_records counted it among the records already
                continue
            yield messages, where
    bad.check(max_bad_fraction)
    if line := bad.line():
        print(f"shardlm: warning: {line}", file=sys.stderr, flush=True)


# -- templates -------------------------------------------------------------------------------------
class PlainTemplate:
    """The built-in format (see the module docstring); the EOS after each answer is a token id."""

    name = "plain"
    HEADERS = {"system": "### System:\n", "user": "### User:\n", "assistant": "### Assistant:\n"}

    def __init__(self, eos_id: int):
        self.eos_id = eos_id

    def segments(self, messages: list[Message], where: str = "") -> list[Segment]:
        out: list[Segment] = []
        for m in messages:
            out.append((self.HEADERS[m["role"]], False))
            if m["role"] == "assistant":
                out += [(m["content"], True), (self.eos_id, True)]
            else:
                out.append((m["content"] + "\n\n", False))
        return out


def _token_string(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _compile(source: str):
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("the tokenizer has a chat template, which needs jinja2: pip install jinja2") from None

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (HF's assistant-mask tag) renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise DataError(f"chat template: syntax error at line {e.lineno}: {e.message}") from None


class ChatTemplate:
    """A Jinja chat template; `segments` splits its rendering into prompt and answer spans."""

    name = "chat_template"

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        self.template = _compile(source)
        self.special = dict(special_tokens or {})
        self.special.setdefault("bos_token", "")
        self.special.setdefault("eos_token", "")
        self.end_markers = [t for t in dict.fromkeys([self.special["eos_token"], *_EOS_CANDIDATES]) if t]

    @classmethod
    def from_dir(cls, tokenizer_dir: str | Path | None) -> ChatTemplate | None:
        """The template saved in a tokenizer's folder (`Tokenizer.directory`; None: no folder), or None."""
        if tokenizer_dir is None:
            return None
        d = Path(tokenizer_dir)
        cfg: dict = {}
        if (d / "tokenizer_config.json").is_file():
            try:
                cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"{d / 'tokenizer_config.json'}: not valid JSON ({e})") from None
        source = cfg.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if (d / "chat_template.jinja").is_file():
            source = (d / "chat_template.jinja").read_text(encoding="utf-8")
        if not isinstance(source, str) or not source.strip():
            return None
        special = {k: s for k, v in cfg.items() if k.endswith("_token") and (s := _token_string(v)) is not None}
        return cls(source, special)

    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)

    def spans(self, messages: list[Message], where: str = "") -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the [start, end) character span of each assistant answer."""
        try:
            text = self.render(messages)
        except Exception as e:  # raise_exception, sandbox refusals, or a template bug (TypeError, ...)
            raise DataError(f"{where}: the chat template refused this record: {e}") from None
        spans: list[tuple[int, int]] = []
        pos = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            span = self._span_by_prefix(messages, i, text, pos)
            if span is None:
                span = self._span_by_search(m["content"], text, pos)
            if span is None:
                if not m["content"]:
                    continue
                raise DataError(f"{where}: the chat template does not render assistant message {i} verbatim, "
                                  "so its tokens cannot be found for loss masking")
            spans.append(span)
            pos = span[1]
        return text, spans

    def _span_by_prefix(self, messages, i, text, pos):
        try:
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1])
        except Exception:  # e.g. a template that insists on a complete conversation
            return None
        if len(before) < pos or not text.startswith(before) or not text.startswith(through):
            return None
        start, end = len(before), len(through.rstrip())
        content = messages[i]["content"]
        if content:
            c = text.find(content, start, len(through))
            if c >= 0:
                end = max(end, c + len(content))
        return start, max(start, end)

    def _span_by_search(self, content, text, pos):
        for cand in dict.fromkeys([content, content.strip()]):
            if not cand:
                continue
            c = text.find(cand, pos)
            if c >= 0:
                end = c + len(cand)
                marker = next((t for t in self.end_markers if text.startswith(t, end)), "")
                return c, end + len(marker)
        return None

    def segments(self, messages: list[Message], where: str = "") -> list[Segment]:
        text, spans = self.spans(messages, where)
        out: list[Segment] = []
        pos = 0
        for a, b in spans:
            out += [(text[pos:a], False), (text[a:b], True)]
            pos = b
        out.append((text[pos:], False))
        return [s for s in out if s[0] != ""]


# -- tokenisation ----------------------------------------------------------------------------------
def tokenize_records(records, tokenizer, template) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(messages, where) records -> (ids int32, is-answer bool) samples.

    Every text segment of a record is encoded on its own (no special tokens added; the texts go
    through `encode_texts`, a batch at a time) and the ids concatenated; a literal id is one token.
    """
    segments, pieces = itertools.tee(template.segments(messages, where) for messages, where in records)
    encoded = encode_texts(tokenizer, (piece for segs in pieces for piece, _ in segs if isinstance(piece, str)))
    for segs in segments:
        ids = [next(encoded) if isinstance(piece, str) else np.array([int(piece)]) for piece, _ in segs]
        mask = [np.full(len(a), loss, dtype=bool) for a, (_, loss) in zip(ids, segs)]
        yield (np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, np.int32),
               np.concatenate(mask) if mask else np.zeros(0, bool))


# -- batching --------------------------------------------------------------------------------------
def pack_best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices grouped into rows of at most `capacity` (best-fit decreasing, deterministic)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (room left, row)
    for i in order:
        n = lengths[i]
        j = bisect_left(free, (n, -1))
        if j == len(free):
            rows.append([i])
            row, room = len(rows) - 1, capacity - n
        else:
            room, row = free.pop(j)
            rows[row].append(i)
            room -= n
        if room > 0:
            insort(free, (room, row))
    return rows


class SFTLoader(RowLoader):
    """PackedLoader's interface over SFT samples: rows of (inputs, labels) with answer-only labels.

    `samples` are (token ids, answer mask) pairs of equal length; they are truncated, filtered and
    packed (or padded) here, and `stats` says how: samples kept, truncated, dropped, tokens, loss
    tokens, rows and the fill of the rows. `lengths[i]` is kept sample i's number of (input, label) pairs.
    """

    def __init__(self, samples: Sequence[tuple[Sequence[int], Sequence[bool]]], seq_len: int,
                 micro_batch_size: int, grad_accum: int, dp_rank: int, dp_size: int, seed: int = 0,
                 shuffle: bool = True, pack: bool = True, pad_id: int = 0, document_mask: bool = False):
        L = self.seq_len = seq_len
        self.pack, self.pad_id, self.document_mask = pack, pad_id, document_mask
        xs, ys, lengths = [], [], []
        truncated = dropped = 0
        for ids, mask in samples:
            ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)
            if len(ids) != len(mask):
                raise ValueError("token ids and answer mask differ in length")
            if len(ids) > L + 1:
                ids, mask = ids[: L + 1], mask[: L + 1]
                truncated += 1
            if len(ids) < 2 or not mask[1:].any():
                dropped += 1
                continue
            xs.append(ids[:-1])
            ys.append(np.where(mask[1:], ids[1:], IGNORE_INDEX))
            lengths.append(len(ids) - 1)
        if not lengths:
            raise DataError("no SFT sample has an answer token left within data.seq_len"
                            + (f" ({dropped} dropped)" if dropped else "") + "; add data or raise data.seq_len")
        self._x = np.concatenate(xs).astype(np.int32)
        self._y = np.concatenate(ys).astype(np.int32)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self._off = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        self._rows = pack_best_fit(lengths, L) if pack else [[i] for i in range(len(lengths))]
        super().__init__(SampleOrder(len(self._rows), micro_batch_size, grad_accum, dp_rank, dp_size, seed, shuffle))
        n_tok = int(self.lengths.sum())
        self.stats = {"samples": len(lengths), "truncated": truncated, "dropped": dropped,
                      "tokens": n_tok + len(lengths),  # each sample's n tokens give n - 1 pairs
                      "loss_tokens": int((self._y != IGNORE_INDEX).sum()), "rows": self.n_rows,
                      "fill": round(n_tok / (self.n_rows * L), 4)}

    def row(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        """Row w as (inputs, labels), each seq_len long; the tail is padding."""
        x = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        y = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        pos = 0
        for i in self._rows[w]:
            o, n = self._off[i], self.lengths[i]
            x[pos : pos + n] = self._x[o : o + n]
            y[pos : pos + n] = self._y[o : o + n]
            pos += n
        return x, y

    def row_positions(self, w: int) -> np.ndarray:
        """Row w's positions: 0, 1, ... within each sample, then 0, 1, ... over the padding."""
        lengths = [int(self.lengths[i]) for i in self._rows[w]]
        pad = self.seq_len - sum(lengths)
        return np.concatenate([np.arange(n, dtype=np.int64) for n in [*lengths, pad]])

    def row_samples(self, w: int) -> list[int]:
        """Indices (among the kept samples, in input order) of the samples in row w, in row order."""
        return list(self._rows[w])

    def rows(self, ids: list[int]) -> tuple[torch.Tensor, ...]:
        """(inputs, labels), or (inputs, labels, positions) with `document_mask`; each (len(ids), seq_len)."""
        rows = [self.row(w) for w in ids]
        out = (torch.from_numpy(np.stack([r[0] for r in rows])), torch.from_numpy(np.stack([r[1] for r in rows])))
        if not self.document_mask:
            return out
        return (*out, torch.from_numpy(np.stack([self.row_positions(w) for w in ids])))


def load_template(tokenizer, tokenizer_dir: str | Path | None) -> ChatTemplate | PlainTemplate:
    """The chat template in the folder `tokenizer_dir` if it has one, else the plain template."""
    return ChatTemplate.from_dir(tokenizer_dir) or PlainTemplate(tokenizer.eos_id)


def build_sft_loader(files: Sequence[Path], tokenizer, tokenizer_dir: str | Path | None, *, seq_len: int,
                     micro_batch_size: int, grad_accum: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                     shuffle: bool = True, pack: bool = True, document_mask: bool = False,
                     max_bad_fraction: float = 0.001) -> tuple[SFTLoader, dict]:
    """Read, render, tokenise and batch SFT records -> (loader, stats).

    `tokenizer_dir`: the folder whose chat template renders the records (`tokenizer.directory`;
    None, or a folder without one: the plain template). `document_mask`: rows also carry positions
    (`SFTLoader.rows`), so the model attends within each sample only.
    stats: records, samples (kept), truncated, dropped (no answer token within seq_len), tokens,
    loss_tokens, rows, fill (non-padding share of the rows), template (`chat_template` or `plain`).
    Every rank does the whole (in-memory) pass; the result is deterministic.
    """
    template = load_template(tokenizer, tokenizer_dir)
    records = list(iter_records(files, max_bad_fraction))
    if not records:
        raise DataError(f"no SFT records found in {', '.join(map(str, files)) or 'data.path'} "
                        f"(each record must be one of {SHAPES})")
    samples = list(tokenize_records(records, tokenizer, template))
    loader = SFTLoader(samples, seq_len, micro_batch_size, grad_accum, dp_rank, dp_size, seed, shuffle, pack,
                       pad_id=tokenizer.eos_id, document_mask=document_mask)
    return loader, {"records": len(records), **loader.stats, "template": template.name}
