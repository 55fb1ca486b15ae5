"""lm-evaluation-harness on a shardlm model, from a checkpoint or an HF folder, with no conversion to HF first.

    from shardlm.eval.harness import ShardlmLM
    lm = ShardlmLM(checkpoint="runs/x/checkpoints/step-200")      # or hf=DIR, or ShardlmLM(load_for_inference(...))
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])       # or model="shardlm", model_args="hf=DIR"

`ShardlmLM` is an `lm_eval.api.model.TemplateLM` (registered as the lm-eval model "shardlm") that scores as
lm-eval's HF backend (`HFLM`) does, so the two give the same numbers on the same weights:

- Text to ids: the tokenizer with its own special tokens (the BOS an HF tokenizer's post-processor adds, as
  `transformers`' `tokenizer(text)`; `add_bos_token` forces them on or off), none for a text that already starts
  with the prefix token. A (context, continuation) pair is encoded whole and split at the context's length, and
  an empty context is the prefix token: BOS, else EOS, as tokenizer_config.json declares them (lm-eval's
  TemplateLM; EOS falls back to the tokenizer's end-of-text token).
- loglikelihood: a request reads the last `max_length` tokens before its final one (context + continuation,
  truncated from the left) and scores the continuation: the sum of its tokens' log-probabilities (log-softmax in
  fp32) and whether each is the argmax. Windows run longest first, `batch_size` to a forward, right-padded (a row
  never reads the padding after it); requests with the same window (the choices of a question whose answers are
  one token) share one row.
- loglikelihood_rolling: the text without special tokens, after the prefix token, cut into disjoint windows of
  `max_length` (lm_eval.utils.get_rolling_token_windows): every token is scored once; the sum. (HFLM also encodes
  the text with its special tokens, so with a BOS-adding tokenizer it scores a second BOS after the first,
  lm-eval issue #3333; here the text is conditioned on one prefix token, as lm-eval's LM API defines it.)
- generate_until: `generate.generate_batch` (KV cache) from the context's last `max_length - max_gen_toks` tokens,
  greedy unless the task's gen_kwargs sample; up to `max_gen_toks` new tokens (the task's, else ours) or a stop
  id; the text is cut at the first `until` string (the EOS text included, as HFLM does).

Under torchrun the model is sharded (`load_for_inference`) and every rank runs every request in the same order,
so the forwards go in lockstep: to lm-eval each rank is a whole evaluation (rank 0 of 1; no data-parallel split
of the requests) and only rank 0 shows progress. Needs the [eval] extra (lm-eval).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from shardlm.config import Config
from shardlm.errors import ConfigError
from shardlm.generate import Sampling, generate_batch
from shardlm.inference import Inference, load_for_inference

log = logging.getLogger(__name__)

Request = tuple[Any, list[int], list[int]]  # (lm-eval's cache key or None, context ids, continuation ids)
DEFAULT_BATCH_SIZE = 8


def declared_token(tokenizer, key: str) -> int | None:
    """The id of the special token an HF tokenizer's folder declares as `key` ("bos_token", "eos_token":
    tokenizer_config.json, where `transformers` reads them), when it is in the vocab; else None."""
    hf, folder = getattr(tokenizer, "tok", None), getattr(tokenizer, "directory", None)
    path = folder / "tokenizer_config.json" if folder is not None else None
    if hf is None or path is None or not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, dict):  # {"content": "<s>", ...}
        value = value.get("content")
    return hf.token_to_id(value) if isinstance(value, str) else None


def parse_gen_kwargs(gen_kwargs: dict, default_max: int) -> tuple[list[str], int, Sampling]:
    """(until strings, max new tokens, Sampling) from a generate_until request's gen_kwargs."""
    kw = dict(gen_kwargs)
    until = kw.pop("until", None)
    until = [until] if isinstance(until, str) else list(until or [])
    n = default_max
    for k in ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens"):
        n = kw.pop(k, n)
    do_sample = bool(kw.pop("do_sample", False))  # HFLM: greedy unless do_sample, whatever the temperature
    t = kw.pop("temperature", None)
    temperature = (1.0 if t is None else float(t)) if do_sample else 0.0
    sampling = Sampling(temperature, int(kw.pop("top_k", 0) or 0), float(kw.pop("top_p", 1.0) or 1.0),
                        int(kw.pop("seed", 0) or 0))
    if kw:
        log.warning("generate_until: ignoring gen_kwargs %s (shardlm takes until, max_gen_toks, do_sample, "
                    "temperature, top_k, top_p, seed)", sorted(kw))
    return until, int(n), sampling


@register_model("shardlm")
class ShardlmLM(TemplateLM):
    """lm-eval's model interface over `shardlm.inference` (see the module docstring)."""

    def __init__(self, inference: Inference | None = None, *, hf: str | None = None, checkpoint: str | None = None,
                 tokenizer: str | None = None, batch_size: int | str = DEFAULT_BATCH_SIZE,
                 max_length: int | None = None, max_gen_toks: int = 256, add_bos_token: bool | None = None,
                 device: str | None = None, max_batch_size: int | None = None):
        super().__init__()
        if inference is None:
            cfg = Config()
            if device is not None:
                cfg.train.device = str(device).partition(":")[0]
            inference = load_for_inference(hf=hf, checkpoint=checkpoint, cfg=cfg, tokenizer=tokenizer)
        self.inf = inference
        if isinstance(batch_size, str) and not batch_size.isdigit():  # "auto", "auto:4": lm-eval's HF batch search
            log.warning("batch_size=%s: shardlm does not search batch sizes; using %d", batch_size, DEFAULT_BATCH_SIZE)
            batch_size = DEFAULT_BATCH_SIZE
        self._batch_size = int(batch_size)
        self._max_length = int(max_length or inference.context)
        self._max_gen_toks = int(max_gen_toks)
        if self._batch_size < 1 or not 1 <= self._max_length <= inference.context or self._max_gen_toks < 1:
            raise ConfigError(f"batch_size ({self._batch_size}) and max_gen_toks ({self._max_gen_toks}) must be >= 1 "
                              f"and max_length ({self._max_length}) between 1 and the model's context "
                              f"({inference.context})")
        self.add_bos_token = None if add_bos_token is None else bool(add_bos_token)
        tok = inference.tokenizer
        self._eot = declared_token(tok, "eos_token")
        self._prefix = declared_token(tok, "bos_token")
        hf_tok = getattr(tok, "tok", None)
        self._prefix_text = hf_tok.decode([self.prefix_token_id], skip_special_tokens=False) if hf_tok else None

    # -- what lm-eval asks of a model ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self._eot if self._eot is not None else self.inf.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix if self._prefix is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self.inf.device

    @property
    def tokenizer_name(self) -> str:
        return str(self.inf.config.data.tokenizer).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The chat template's fingerprint (lm-eval records it and keys its cache on it), or None."""
        return self.inf.template.fingerprint if self.inf.template is not None and chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.inf.template is None:
            raise ConfigError("--apply-chat-template: this model's tokenizer has no chat template; drop the flag")
        return self.inf.template.render(chat_history, add_generation_prompt=add_generation_prompt)

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records of the model in its results' config."""
        return {"model_source": self.inf.source, "model_num_parameters": self.inf.model_cfg.num_params(),
                "model_dtype": self.inf.precision, "max_length": self.max_length}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        hf = getattr(self.inf.tokenizer, "tok", None)
        if hf is None:  # bytes: no special tokens to add
            ids = self.inf.tokenizer.encode(string)
        else:
            add = add_special_tokens if add_special_tokens is not None else self.add_bos_token
            if add_special_tokens is None and self._prefix_text and string.startswith(self._prefix_text):
                add = False  # the text brings its own
            ids = hf.encode(string, add_special_tokens=True if add is None else add).ids
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.inf.tokenizer.decode(ids)

    # -- scoring -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether it is greedy) per (key, context, continuation)."""
        windows: dict[tuple[int, ...], list[int]] = {}  # input window -> the requests that read it
        truncated = 0
        for i, (_, context, continuation) in enumerate(requests):
            if not context or not continuation or len(continuation) > self.max_length:
                raise ConfigError(f"a request of {len(context)} context and {len(continuation)} continuation tokens "
                                  f"does not fit: the continuation must be 1 to max_length ({self.max_length}) tokens "
                                  "after at least one context token; raise --max-length")
            truncated += len(context) + len(continuation) > self.max_length + 1
            windows.setdefault(tuple((context + continuation)[-(self.max_length + 1):-1]), []).append(i)
        if truncated and self.inf.is_rank0:
            log.warning("%d of %d requests are longer than max_length (%d) + 1 tokens: their contexts are truncated "
                        "from the left", truncated, len(requests), self.max_length)
        order = sorted(windows, key=lambda w: (-len(w), w))  # longest first: the first batch is the largest
        out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or not self.inf.is_rank0, desc="loglikelihood")
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            logits = self._forward(rows)
            for row, row_logits in zip(rows, logits):
                for i in windows[row]:
                    key, _, continuation = requests[i]
                    out[i] = self._score(row_logits[len(row) - len(continuation):len(row)], continuation)
                    if key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, out[i])
                    bar.update(1)
        bar.close()
        return out

    def _forward(self, rows: list[tuple[int, ...]]) -> torch.Tensor:
        """(B, T, vocab) logits of the rows, right-padded to the longest (with each row's last token)."""
        width = max(len(r) for r in rows)
        tokens = torch.tensor([list(r) + [r[-1]] * (width - len(r)) for r in rows], device=self.inf.device)
        return self.inf.model(tokens)

    @staticmethod
    def _score(logits: torch.Tensor, targets: list[int]) -> tuple[float, bool]:
        logp = logits.float().log_softmax(-1)
        t = torch.tensor(targets, device=logp.device)
        return float(logp.gather(-1, t[:, None]).sum()), bool((logp.argmax(-1) == t).all())

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows: list[Request] = []
        owner: list[int] = []
        for i, (text,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(text, add_special_tokens=False)
            for context, pred in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, context, pred))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation ----------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}  # the requests of one gen_kwargs decode together
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out = [""] * len(requests)
        hf = getattr(self.inf.tokenizer, "tok", None)
        eos = hf.decode([self.eot_token_id], skip_special_tokens=False) if hf is not None else ""
        bar = tqdm(total=len(requests), disable=disable_tqdm or not self.inf.is_rank0, desc="generate_until")
        for members in groups.values():
            until, n, sampling = parse_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks)
            room = self.max_length - n
            if room < 1:
                raise ConfigError(f"a task asks for {n} new tokens, which leaves no room for a prompt in max_length "
                                  f"({self.max_length}); raise --max-length or lower the task's max_gen_toks")
            stops = [s for s in [*until, eos] if s]
            prompts = [self.tok_encode(requests[i].args[0], left_truncate_len=room) or [self.prefix_token_id]
                       for i in members]
            done = generate_batch(self.inf.model, prompts, n, sampling=sampling, stop_ids=self.inf.stop_ids,
                                  context=self.max_length, batch_size=self.batch_size, device=self.inf.device)
            for i, c in zip(members, done):
                text = self.tok_decode(c.ids)
                for s in stops:
                    text = text.split(s)[0]
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(1)
        bar.close()
        return out


__all__ = ["ShardlmLM", "declared_token", "parse_gen_kwargs"]
