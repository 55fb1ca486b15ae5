"""SFT records -> conversations -> rendered text -> token ids + an answer mask (one sample per record).

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

This module has no torch: `shardlm prepare`'s worker processes render and tokenise records with it
(`shardlm.data.store`), and the loader (`shardlm.data.sft`) reads the result from the token store.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from shardlm.data.sources import BadRecords, Unit, read_records
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


def unit_messages(unit: Unit, bad: BadRecords) -> Iterator[tuple[list[Message], str]]:
    """(messages, location) for every record of one unit of the input (`shardlm.data.sources.plan_units`: a
    .jsonl(.gz/.zst) byte range, a parquet row group, an arrow batch, ...), in order. A record that is not JSON,
    not an object or of no known shape is skipped and counted in `bad` with its location."""
    for record, where in read_records(unit, bad):
        try:
            messages = record_to_messages(record, where)
        except DataError as e:
            reason, _, detail = str(e).removeprefix(f"{where}: ").partition("; ")
            bad.add_bad(where, reason, detail)
            bad.total -= 1  # read_records counted it among the records already
            continue
        yield messages, where


def record_key(messages: list[Message]) -> str:
    """A conversation as one string: what the validation split hashes (`shardlm.data.store.prepare.in_val`)."""
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


# -- templates -------------------------------------------------------------------------------------
class PlainTemplate:
    """The built-in format (see the module docstring); the EOS after each answer is a token id."""

    name = "plain"
    fingerprint = "plain-v1"  # what a token store records of the template (it shapes the ids and masks)
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
        blob = json.dumps({"source": source, "special": self.special}, sort_keys=True)
        self.fingerprint = "chat-" + hashlib.sha256(blob.encode()).hexdigest()[:16]
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


def answer_info(mask: np.ndarray) -> tuple[int, int]:
    """(first answer position >= 1, or 0 when none; answer tokens at positions >= 1): what decides, for any
    seq_len, whether a sample is kept and how many loss tokens it has (`SFTSamples.answers`)."""
    tail = np.asarray(mask[1:], dtype=bool)
    hit = np.flatnonzero(tail)
    return (int(hit[0]) + 1 if hit.size else 0, int(tail.sum()))


def load_template(tokenizer, tokenizer_dir: str | Path | None) -> ChatTemplate | PlainTemplate:
    """The chat template in the folder `tokenizer_dir` if it has one, else the plain template."""
    return ChatTemplate.from_dir(tokenizer_dir) or PlainTemplate(tokenizer.eos_id)
