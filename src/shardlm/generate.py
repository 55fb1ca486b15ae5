"""Decoding: prompts in, new tokens out, with a KV cache; one process, or every rank of a sharded model.

    generate_batch(model, prompts, max_new_tokens, sampling=Sampling(...), stop_ids=..., on_token=...) -> [Completion]

How a batch runs: the prompts (token ids) are left-padded into one (B, T) tensor and run once (the
prefill) into a `KVCache`; then each step feeds one token per row, so a step costs one token's forward
however long the prefix. Padding is exact: each row's logits are those of the row alone (the cache
gives each token its own position and keeps padding unread). Prompts are grouped `batch_size` at a
time, longest first (less padding); the results come back in the order given.

Choosing the next token, per row, on the host in fp32: greedy (argmax, the first of equal maxima, as
`transformers` does) when `temperature == 0`; else logits / temperature, then top-k, then top-p (the
smallest set of tokens whose probability reaches top_p; `transformers`' warpers, in that order), then a
draw from a generator seeded by (seed, the prompt's index). So a prompt's sample depends on the seed and
its place in the list, not on the batch size or its neighbours. A row stops at the first stop id (it is
kept, as `transformers` keeps EOS), after `max_new_tokens`, or when it fills the context.

Sharded models (FSDP): every rank must call this with the same prompts and settings. All ranks run the
same forwards in lockstep (each block all-gathers its parameters) and rank 0's tokens are broadcast
every step, so the ranks can never drift apart, even where their logits differed in the last bit.

The context (default: the model's max_seq_len, its RoPE table; never more) bounds each row: prompt + new
tokens <= context, so a row that reaches it ends there (finish "context"), and a prompt that leaves no room
for one new token is a ConfigError. `check_context` gives the one warning line to show beforehand.
Positions past the context were never trained: a row does not silently run on into them.

Streaming: `on_token(i, id)` is called for each new token of prompt i as soon as it is chosen (every rank
alike); `TextStream` turns those ids into text pieces that are safe to print (whole characters and words).
`use_cache=False` recomputes the whole row for every token through the training forward (no cache at
all): the reference the cache is tested against, and the baseline of benchmarks/generate.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardlm.data.chat import PlainTemplate
from shardlm.errors import ConfigError

Message = dict[str, str]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (see the module docstring)."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0

    def __post_init__(self) -> None:
        # a negative temperature used to be taken as greedy: a setting that silently did something else
        if self.top_k < 0 or not 0.0 < self.top_p <= 1.0 or not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"sampling needs top_k >= 0, 0 < top_p <= 1 and a temperature >= 0 (0 = greedy); got "
                             f"top_k={self.top_k}, top_p={self.top_p}, temperature={self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        parts += [f"top-k {self.top_k}"] if self.top_k else []
        parts += [f"top-p {self.top_p:g}"] if self.top_p < 1 else []
        return f"sampling ({', '.join(parts)}, seed {self.seed})"


@dataclass
class Completion:
    """One prompt's result: the new ids (a final stop id included) and why it ended."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    finish: str = "length"  # "stop": a stop id was generated; "length": max_new_tokens; "context": the context is full

    @property
    def text_ids(self) -> list[int]:
        """`ids` without the final stop id (what to print)."""
        return self.ids[:-1] if self.finish == "stop" else self.ids


# -- choosing the next token --------------------------------------------------------------------------
def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """(B, V) logits with everything below each row's k-th largest set to -inf (ties kept); k <= 0: unchanged."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """(B, V) logits keeping, per row, the most likely tokens whose probabilities first reach `p` together
    (at least one); the rest -inf. `transformers`' TopPLogitsWarper; p >= 1: unchanged."""
    if p >= 1.0:
        return logits
    ascending, order = torch.sort(logits, dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - p)
    drop[..., -1:] = False  # the most likely token always stays
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def row_generator(seed: int, index: int) -> torch.Generator:
    """The CPU generator of prompt number `index` (its draws do not depend on the batch it is in)."""
    return torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + index) % (1 << 63))


def next_tokens(logits: torch.Tensor, sampling: Sampling, generators: Sequence[torch.Generator] | None) -> torch.Tensor:
    """(B,) int64 next ids from (B, V) fp32 host logits; `generators` (one per row) unless greedy."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = top_p_filter(top_k_filter(logits / sampling.temperature, sampling.top_k), sampling.top_p)
    probs = logits.softmax(dim=-1)
    return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)])


# -- prompts -----------------------------------------------------------------------------------------
def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """`prompt` encoded; an empty prompt starts at a document boundary (EOS), as each document does in
    the packed training data, so the model samples the start of a document."""
    return tokenizer.encode(prompt) or [tokenizer.eos_id]


def encode_prompt(tokenizer, prompt: str | list[Message], template: Any = None) -> list[int]:
    """A prompt's ids as the model saw such text in training or fine-tuning.

    With a chat template (`shardlm.data.sft.ChatTemplate`): the prompt (text = one user message, or a list
    of messages) rendered with `add_generation_prompt=True` and encoded without added special tokens (the
    template writes its own), as SFT and `transformers`' `apply_chat_template` do. Messages without a
    template: SFT's plain format (`### User:` ... `### Assistant:`). Plain text: encoded with the
    tokenizer's own special tokens (an HF tokenizer's BOS, as `transformers`' `tokenizer(text)`); an
    empty prompt is [EOS] (`prompt_ids`).
    """
    if template is not None:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tokenizer.encode(template.render(messages, add_generation_prompt=True)) or [tokenizer.eos_id]
    if not isinstance(prompt, str):
        segments = PlainTemplate(tokenizer.eos_id).segments(prompt) + [(PlainTemplate.HEADERS["assistant"], False)]
        return [i for s, _ in segments for i in ([s] if isinstance(s, int) else tokenizer.encode(s))]
    hf = getattr(tokenizer, "tok", None)  # a `tokenizers.Tokenizer`: its post-processor adds BOS where it has one
    ids = hf.encode(prompt, add_special_tokens=True).ids if hf is not None and prompt else prompt_ids(tokenizer, prompt)
    return ids or [tokenizer.eos_id]


# -- the context -------------------------------------------------------------------------------------
def check_context(prompts: Sequence[Sequence[int]], max_new_tokens: int, context: int,
                  flag: str = "max_new_tokens") -> str | None:
    """The one warning line to show when some prompt + `max_new_tokens` runs past `context` (those rows stop
    there), else None; `flag` names the setting in it. ConfigError, naming both numbers, when a prompt leaves
    no room for a new token."""
    for i, p in enumerate(prompts):
        if len(p) >= context:
            which = "the prompt" if len(prompts) == 1 else f"prompt {i + 1}"
            raise ConfigError(f"{which} has {len(p)} tokens and the model's context is {context}: no room for a "
                              f"new token; shorten it to at most {context - 1} tokens")
    longest = max((len(p) for p in prompts), default=0)
    if longest + max_new_tokens <= context:
        return None
    room = context - longest
    if len(prompts) == 1:
        where, outcome = f"prompt {longest}", f"stopping at {room} new tokens"
    else:
        over = sum(len(p) + max_new_tokens > context for p in prompts)
        where, outcome = (f"{over} of {len(prompts)} prompts, the longest {longest}",
                          f"they stop there ({room} new tokens for the longest)")
    return (f"{flag} {max_new_tokens} runs past the model's context of {context} tokens ({where}): {outcome}; "
            f"ask for at most {room} to fit")


class TextStream:
    """Token ids in, printable text out as it becomes stable (the prefix/read offsets of TGI and vLLM).

    A piece is what decoding the ids since the last piece adds to the text, with the few ids before them as
    context (so a tokenizer that drops a leading space at the start of a text keeps it here). Nothing comes
    out while the text ends in U+FFFD (a UTF-8 character still split across ids), so the pieces joined equal
    decoding all the ids at once. `skip` ids (the stop ids, which a completion's text leaves out) are dropped.
    """

    def __init__(self, tokenizer, skip: Iterable[int] = ()):
        self.tokenizer, self.skip = tokenizer, frozenset(skip)
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] decoded last time; ids[read:] not printed yet

    def push(self, token: int) -> str:
        """The text `token` completes ('' while a character is still open or it decodes to nothing)."""
        if token in self.skip:
            return ""
        self.ids.append(token)
        if self.tokenizer.decode(self.ids[self.prefix:]).endswith("\ufffd"):
            return ""
        return self.flush()

    def flush(self) -> str:
        """Whatever is left, complete or not (the end of the text)."""
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


# -- the decoding loop --------------------------------------------------------------------------------
def _left_pad(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) tokens, rows right-aligned (padding repeats the row's first token: never read), and (B,) pads."""
    width = max(len(r) for r in rows)
    pad = torch.tensor([width - len(r) for r in rows])
    tokens = torch.tensor([[r[0]] * (width - len(r)) + list(r) for r in rows], device=device)
    return tokens, pad


def _recompute_logits(model: nn.Module, rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Last-token logits of each row through the training forward, no cache. Padding is made exact by
    document positions: each pad is a one-token document of its own and the row starts a new one at 0."""
    tokens, pad = _left_pad(rows, device)
    width = tokens.shape[1]
    positions = None
    if bool(pad.any()) or width > model.cfg.max_seq_len:  # the RoPE table covers max_seq_len positions
        positions = (torch.arange(width)[None, :] - pad[:, None]).clamp_min(0).to(device)
    return model(tokens, positions, last_only=True)


def _is_sharded(model: nn.Module) -> bool:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def _eager(model: nn.Module) -> contextlib.AbstractContextManager:
    """Compiled blocks (train.compile) run eagerly here: a cache whose length changes every step would
    recompile them at each token."""
    if any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()):
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


def _decode(model: nn.Module, prompts: Sequence[Sequence[int]], indices: Sequence[int], max_new_tokens: int,
            sampling: Sampling, stop: frozenset[int], context: int, use_cache: bool, device: torch.device,
            sync: bool, on_token: Callable[[int, int], None] | None) -> list[Completion]:
    """One batch: prefill, then one token per step for every row until each has stopped."""
    import torch.distributed as dist

    out = [Completion(prompt=list(p)) for p in prompts]
    seqs = [list(p) for p in prompts]
    caps = [min(max_new_tokens, context - len(p)) for p in prompts]  # a row ends at the context
    done = [False] * len(prompts)
    gens = None if sampling.greedy else [row_generator(sampling.seed, i) for i in indices]
    cache = None
    for _ in range(max(caps)):
        if not use_cache:
            logits = _recompute_logits(model, seqs, device)
        elif cache is None:  # the prefill: room for the prompts and every token still to feed
            tokens, pad = _left_pad(seqs, device)
            cache = model.new_cache(len(seqs), tokens.shape[1] + max(caps) - 1, pad)
            logits = model(tokens, cache=cache, last_only=True)
        else:
            logits = model(torch.tensor([[s[-1]] for s in seqs], device=device), cache=cache, last_only=True)
        nxt = next_tokens(logits[:, -1].float().cpu(), sampling, gens)
        if sync:  # rank 0 decides: every rank feeds the same tokens and stops at the same step
            dist.broadcast(nxt, src=0)
        for b, tok in enumerate(nxt.tolist()):
            seqs[b].append(tok)  # a finished row is fed on (its tokens are dropped): the batch stays rectangular
            if done[b]:
                continue
            out[b].ids.append(tok)
            if tok in stop:
                done[b], out[b].finish = True, "stop"
            elif len(out[b].ids) == caps[b]:
                done[b], out[b].finish = True, "length" if caps[b] == max_new_tokens else "context"
            if on_token is not None:
                on_token(indices[b], tok)
        if all(done):
            break
    return out


@torch.no_grad()
def generate_batch(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   sampling: Sampling = Sampling(), stop_ids: Iterable[int] = (), context: int | None = None,
                   use_cache: bool = True, batch_size: int | None = None, device: torch.device | None = None,
                   on_token: Callable[[int, int], None] | None = None) -> list[Completion]:
    """Continue each prompt (token ids) by up to `max_new_tokens` tokens; one Completion per prompt, in order.

    `model` is our Transformer (plain, or FSDP-sharded: then every rank calls this alike). `stop_ids` end a
    row; `context` (default and most: the model's max_seq_len) bounds prompt + new tokens, a prompt that
    fills it is a ConfigError (`check_context`); `batch_size` prompts run at once (default: all); `device`:
    where the tokens go (default: the parameters'); `on_token(i, id)`: each new token of prompt i as it is
    chosen. `use_cache=False` recomputes every step without a cache. The model runs in eval mode and is put
    back as it was.
    """
    prompts = [list(p) for p in prompts]
    if any(not p for p in prompts):
        raise ValueError("generate needs at least one prompt token (see prompt_ids)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if context is not None and not 0 < context <= model.cfg.max_seq_len:
        raise ValueError(f"context must be in [1, {model.cfg.max_seq_len}] (the model's RoPE table), got {context}")
    context = context or model.cfg.max_seq_len
    check_context(prompts, max_new_tokens, context)
    if not prompts or max_new_tokens == 0:
        return [Completion(prompt=p) for p in prompts]
    device = device or next(model.parameters()).device
    sync, stop = _is_sharded(model), frozenset(stop_ids)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # longest first: less padding
    size = batch_size or len(prompts)
    results: list[Completion | None] = [None] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        with _eager(model):
            for start in range(0, len(order), size):
                chunk = order[start:start + size]
                done = _decode(model, [prompts[i] for i in chunk], chunk, max_new_tokens, sampling, stop, context,
                               use_cache, device, sync, on_token)
                for i, c in zip(chunk, done):
                    results[i] = c
    finally:
        model.train(was_training)
    return results  # type: ignore[return-value]


def generate(model: nn.Module, prompt: list[int], max_new_tokens: int, context: int | None = None, *,
             temperature: float = 0.8, top_k: int = 50, top_p: float = 1.0, seed: int = 0,
             device: torch.device | None = None, stop_ids: Iterable[int] = (), use_cache: bool = True) -> list[int]:
    """One prompt: the prompt's ids followed by the new ones (the end-of-training sample calls this).

    `generate_batch` with one row; `context`: the most tokens prompt + new may reach (the trainer passes
    data.seq_len; `check_context` gives the warning to show when it cuts the sample short). Under FSDP every
    rank calls it.
    """
    if not prompt:
        raise ValueError("generate needs at least one prompt token (see prompt_ids)")
    (c,) = generate_batch(model, [prompt], max_new_tokens, sampling=Sampling(temperature, top_k, top_p, seed),
                          stop_ids=stop_ids, context=context, use_cache=use_cache, device=device)
    return list(prompt) + c.ids


def sample(model: nn.Module, tokenizer, t, context: int, device: torch.device) -> list[str]:
    """The end-of-training sample (train.sample_tokens from train.sample_prompt, seeded by train.seed): a
    warning line when it would run past the context, then `sample:` and the text."""
    prompt = prompt_ids(tokenizer, t.sample_prompt)
    warning = check_context([prompt], t.sample_tokens, context, "train.sample_tokens")
    ids = generate(model, prompt, t.sample_tokens, context, seed=t.seed, device=device)
    return ([f"sample: warning: {warning}"] if warning else []) + ["sample:\n" + tokenizer.decode(ids)]
