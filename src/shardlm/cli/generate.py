"""`shardlm generate (--hf DIR | --checkpoint DIR) --prompt TEXT ...`: text from a model, with a KV cache."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from shardlm.config import load_config
from shardlm.errors import ConfigError, Interrupted, say

TAKES_OVERRIDES = True


def add_model_source(p: argparse.ArgumentParser) -> None:
    """--hf DIR | --checkpoint DIR, one of them required (generate and eval load a model the same way)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", metavar="DIR", help="an HF model folder (config.json + safetensors + tokenizer)")
    src.add_argument("--checkpoint", metavar="DIR", help="a DCP checkpoint (step-N, or `convert hf-to-dcp` output)")


def add_args(p: argparse.ArgumentParser) -> None:
    p.usage = ("shardlm generate (--hf DIR | --checkpoint DIR) (--prompt TEXT ... | --prompts-file FILE) "
               "[--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--jsonl] "
               "[--train.device=cpu ...]")
    p.description = (
        "Continue prompts with a model from an HF folder or a DCP checkpoint (model-only or full; LoRA adapters\n"
        "are merged on the fly), decoding with a KV cache. Greedy by default (--temperature 0): the same ids as\n"
        "transformers' greedy generate on the same weights. Prompts go through the tokenizer's chat template\n"
        "when it has one. One process for a model that fits one device; under torchrun the model is sharded\n"
        "(each rank reads only its shards) and every rank decodes in lockstep; rank 0 prints. Prompt + new\n"
        "tokens stop at the model's context (one warning line when --max-new-tokens runs past it).")
    p.epilog = ("--section.key=value overrides: train.device (auto/cpu/cuda), train.mixed_precision (auto = bf16 on\n"
                "GPUs, fp32 on CPU), parallel.* under torchrun. Output: one prompt's text streams to stdout as it is\n"
                "made (Ctrl-C keeps it); several prompts print each completion after a `### prompt N` line when all\n"
                "are done; --jsonl: one object per prompt ({prompt, prompt_ids, ids, text, finish: stop | length |\n"
                "context}) at the end. A summary line with tokens/s goes to stderr.")
    add_model_source(p)
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeat for several)")
    p.add_argument("--prompts-file", metavar="FILE",
                   help="prompts: .jsonl ({\"prompt\": str} or {\"messages\": [...]} per line) or text (one a line)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="new tokens per prompt (128)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; prompt i draws from (seed, i) (default 0)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="prompts decoded together (8)")
    p.add_argument("--tokenizer", metavar="SPEC", help="a tokenizer.json, its folder, or bytes (default: the model's)")
    p.add_argument("--no-chat-template", action="store_true", help="encode prompts as plain text")
    p.add_argument("--no-cache", action="store_true", help="recompute every token without a KV cache (slow; a check)")
    p.add_argument("--jsonl", action="store_true", help="one JSON object per prompt on stdout")


def read_prompts(args: argparse.Namespace) -> list:
    """--prompt values, then the --prompts-file entries (strings, or message lists from .jsonl)."""
    prompts: list = list(args.prompt)
    if args.prompts_file:
        path = Path(args.prompts_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompts-file {path}: unreadable ({type(e).__name__}: {e})") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if path.suffix != ".jsonl":
                prompts.append(line)
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not JSON ({e}); write one {{\"prompt\": ...}} object a line") from None
            value = rec.get("prompt", rec.get("messages")) if isinstance(rec, dict) else None
            if not (isinstance(value, str) or (isinstance(value, list) and value and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in value))):
                raise ConfigError(f"{path}:{n}: expected {{\"prompt\": str}} or {{\"messages\": [{{\"role\", "
                                  "\"content\"}, ...]}")
            prompts.append(value)
    if not prompts:
        raise ConfigError("generate needs a prompt: pass --prompt TEXT or --prompts-file FILE")
    return prompts


class Printer:
    """What goes to stdout while decoding: one prompt's text, piece by piece (`TextStream`), flushed at once;
    nothing in the other modes (they print at the end). Counts the new tokens either way."""

    def __init__(self, stream):
        self.stream, self.tokens, self.printed = stream, 0, ""

    def __call__(self, index: int, token: int) -> None:
        self.tokens += 1
        if self.stream is not None:
            self.write(self.stream.push(token))

    def write(self, piece: str) -> None:
        if piece:
            self.printed = piece  # first: Ctrl-C can land as the piece goes out, and the line must still end
            sys.stdout.write(piece)
            sys.stdout.flush()

    def end_line(self, rest: bool = True) -> None:
        """The rest of the text (`rest`: a split character too), then a newline unless the text ended with one
        or nothing was printed."""
        if self.stream is not None and rest:
            self.write(self.stream.flush())
        if self.printed and not self.printed.endswith("\n"):
            self.write("\n")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardlm.generate import Sampling, check_context  # lazy: keeps torch out of --help
    from shardlm.inference import load_for_inference  # lazy: keeps torch out of --help

    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise ConfigError("--max-new-tokens and --batch-size must be >= 1")
    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:
        raise ConfigError(f"{e}: fix --top-k / --top-p / --temperature") from None
    prompts = read_prompts(args)
    cfg = load_config(None, overrides)
    inf = load_for_inference(hf=args.hf, checkpoint=args.checkpoint, cfg=cfg, tokenizer=args.tokenizer)
    try:
        if inf.is_rank0:
            say(f"generate: {inf.describe()}")
        ids = [inf.encode(p, chat=not args.no_chat_template) for p in prompts]
        warning = check_context(ids, args.max_new_tokens, inf.context, "--max-new-tokens")
        if warning and inf.is_rank0:
            say(f"generate: warning: {warning}")
        streaming = inf.is_rank0 and len(prompts) == 1 and not args.jsonl
        start = time.perf_counter()
        done = decode(inf, ids, args, sampling, streaming)
        if done is not None and inf.is_rank0:
            print_results(prompts, done, inf.tokenizer, args, sampling, streaming, time.perf_counter() - start)
    finally:
        inf.close()
    return 0


def decode(inf, ids: list[list[int]], args: argparse.Namespace, sampling, streaming: bool) -> list | None:
    """The completions, one prompt's text streamed to stdout as it is made. Ctrl-C: Interrupted, with what was
    printed kept and its line ended; None when stdout's reader has gone (`| head`)."""
    from shardlm.generate import TextStream, generate_batch  # lazy: keeps torch out of --help

    printer = Printer(TextStream(inf.tokenizer, skip=inf.stop_ids) if streaming else None)
    try:
        done = generate_batch(inf.model, ids, args.max_new_tokens, sampling=sampling, stop_ids=inf.stop_ids,
                              context=inf.context, use_cache=not args.no_cache, batch_size=args.batch_size,
                              device=inf.device, on_token=printer)
        printer.end_line()
        return done
    except KeyboardInterrupt:
        printer.end_line(rest=False)
        kept = ("the text above is what was made" if streaming else
                "nothing was printed (--jsonl and several prompts print when all are done)")
        raise Interrupted(f"generate interrupted after {printer.tokens} new tokens; {kept}") from None
    except BrokenPipeError:  # the reader has gone: stop quietly, as `cat` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return None


def print_results(prompts: list, done: list, tokenizer, args: argparse.Namespace, sampling, streaming: bool,
                  elapsed: float) -> None:
    """--jsonl records or `### prompt N` blocks (a streamed text is out already), then the summary on stderr."""
    for i, (p, c) in enumerate(zip(prompts, done)):
        text = tokenizer.decode(c.text_ids)
        if args.jsonl:
            print(json.dumps({"prompt": p, "prompt_ids": c.prompt, "ids": c.ids, "text": text, "finish": c.finish}),
                  flush=True)
        elif not streaming:
            print(f"### prompt {i + 1} ({len(c.ids)} tokens, {c.finish})\n{text}", flush=True)
    n = sum(len(c.ids) for c in done)
    ended = f" ({done[0].finish})" if len(done) == 1 else ""
    print(f"generate: {len(done)} prompt{'s' if len(done) != 1 else ''}, {n} new tokens{ended} in {elapsed:.2f} s "
          f"({n / max(elapsed, 1e-9):.1f} tokens/s; {sampling.describe()}, "
          f"{'no cache' if args.no_cache else 'KV cache'}, batch {args.batch_size})", file=sys.stderr, flush=True)
