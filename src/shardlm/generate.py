"""Sampling text from a (possibly sharded) model: every rank runs the same steps in lockstep."""

from __future__ import annotations

import torch
from torch import nn


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """`prompt` encoded; an empty prompt starts at a document boundary (EOS), as each document does in
    the packed training data, so the model samples the start of a document."""
    return tokenizer.encode(prompt) or [tokenizer.eos_id]


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], max_new_tokens: int, context: int, *,
             temperature: float = 0.8, top_k: int = 50, seed: int = 0, device: torch.device | None = None) -> list[int]:
    """Top-k sampling without a KV cache (recomputes the window each token: fine for demos and tests).

    Under FSDP all ranks must call this with the same arguments: the forward all-gathers, and the
    shared seed keeps every rank's sampled tokens identical.
    """
    if not prompt:
        raise ValueError("generate needs at least one prompt token (see prompt_ids)")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt)
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-context:]], device=device)
        logits = model(window)[0, -1].float().cpu()
        if temperature <= 0:
            ids.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if top_k > 0:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
    return ids
