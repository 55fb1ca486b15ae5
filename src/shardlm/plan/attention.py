"""Document masks in a plan: which attention the trainer would run, and flex attention on fake CPU tensors.

With data.document_mask the trainer's micro-batches are (inputs, labels, positions) and the model masks
each document (`shardlm.models.llama.document_mask`), built once per forward and passed to every block:

* sdpa-mask (CPUs; GPUs without flex attention): a dense (B, 1, T, T) bool mask, B*T^2 bytes. SDPA turns
  it into an additive mask in the compute dtype in every layer and the kernel keeps that for the layer's
  backward (CPU flash and CUDA memory-efficient attention alike). Without AC: L such masks of B*T^2 elements
  at the peak (the bool mask is freed after the forward); with train.ac=full: the bool mask is every block's
  input, kept until the last backward, and each float mask is rebuilt in its block's backward, one at a time.
  The planner runs this path as it is: SDPA takes the mask on fake tensors.
* flex (CUDA): compiled flex attention with a block-sparse `BlockMask` (int32 block counts and indices,
  O(B*(T/128)^2)); GQA in the kernel (no repeated k/v). Flex attention cannot run on fake CPU tensors (no
  backward on CPU, and it compiles to Triton), so the planner swaps in `FlexMemory`: the tensors the compiled
  kernels allocate and keep, by shape. The BlockMask is `create_block_mask`'s, by shape (`block_mask`).

Either way the positions also change RoPE: cos/sin per token, (B, T, head_dim), instead of a (T, head_dim)
table slice. Plans are for GPUs, so `auto` assumes flex where this torch has it (its CUDA builds ship triton,
which flex needs); `sdpa-mask` plans the dense mask (what a GPU without triton, or a CPU, runs).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch

from shardlm.models import llama

CHOICES = ("auto", "flex", "sdpa-mask")
DENSE = "SDPA with a dense (B, 1, T, T) mask"


def resolve(choice: str = "auto") -> tuple[str, str]:
    """("flex" | "sdpa-mask", why): the attention a plan assumes for document masks, for the report."""
    if choice not in CHOICES:
        raise ValueError(f"document attention must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "sdpa-mask":
        return choice, f"{DENSE}, as asked"
    try:
        from torch.nn.attention.flex_attention import BlockMask  # noqa: F401
    except ImportError:
        if choice == "flex":
            raise ValueError(f"torch {torch.__version__} has no flex attention: plan sdpa-mask") from None
        return "sdpa-mask", f"{DENSE}: torch {torch.__version__} has no flex attention"
    return "flex", ("compiled flex attention with a block-sparse document mask, "
                    + ("as the trainer runs on CUDA GPUs" if choice == "auto" else "as asked"))


FLEX_NOTE = ("data.document_mask with flex attention: planned from what its compiled kernels keep (output, "
             "logsumexp, q/k/v) and a BlockMask of create_block_mask's shapes, since flex cannot run on fake CPU "
             "tensors; --document-attention=sdpa-mask plans the dense mask a GPU without triton uses")


def positions(batch: int, seq_len: int, device: torch.device, doc_len: int = 256) -> torch.Tensor:
    """(B, T) int64 positions within documents, as the loader makes them (here: a document every `doc_len`
    tokens; only the shape and dtype matter to memory)."""
    return (torch.arange(batch * seq_len, device=device) % doc_len).view(batch, seq_len)


def _captured(fn) -> list[torch.Tensor]:
    """Tensors a mask_mod closes over (the document ids): compiled flex keeps them for backward."""
    out = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(v, torch.Tensor):
            out.append(v)
    return out


class FlexMemory(torch.autograd.Function):
    """Compiled flex attention's memory, without its arithmetic (for fake tensors only: values are garbage).

    Forward (the Triton template's outputs): out (B, Hq, T, Dv) in the query dtype and layout and logsumexp
    (B, Hq, T) fp32, kept with q, k, v, the BlockMask's tensors and the mask_mod's captured tensors for backward.
    Backward: delta (B, Hq, T) fp32, then dq and k/v-shaped dk, dv (GQA is done inside the kernel).
    """

    @staticmethod
    def forward(ctx, q, k, v, *mask_tensors):
        b, h, t, _ = q.shape
        order = sorted(range(4), key=lambda i: -q.stride(i))  # out is laid out as q is: o_proj's reshape is a view
        shape = (b, h, t, v.shape[-1])
        out = q.new_empty([shape[i] for i in order]).permute([order.index(i) for i in range(4)])
        lse = q.new_empty(b, h, t, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, *mask_tensors)
        ctx.n_mask = len(mask_tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors[:5]
        delta = torch.empty_like(lse)  # sum(out * grad_out, -1) in fp32, read by the backward kernel
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del delta
        return (dq, dk, dv) + (None,) * ctx.n_mask


def flex_attention(q, k, v, block_mask, enable_gqa: bool = False, **_):
    """Stands in for `torch.compile(flex_attention)` in the model (same call) on fake tensors."""
    tensors = [x for x in block_mask.as_tuple() if isinstance(x, torch.Tensor)]
    return FlexMemory.apply(q, k, v, *tensors, *_captured(block_mask.mask_mod))


def block_mask(mask_mod, B, H, Q_LEN: int, KV_LEN: int, device=None, BLOCK_SIZE: int = 128, **_):
    """Stands in for `torch.compile(create_block_mask)`: a BlockMask with the tensors it returns (partial and
    full block counts and indices per query block, and their transposes per key block; int32), values unset."""
    from torch.nn.attention.flex_attention import BlockMask

    n_q, n_kv = math.ceil(Q_LEN / BLOCK_SIZE), math.ceil(KV_LEN / BLOCK_SIZE)
    num = torch.zeros(B, H or 1, n_q, dtype=torch.int32, device=device)
    idx = torch.zeros(B, H or 1, n_q, n_kv, dtype=torch.int32, device=device)
    return BlockMask.from_kv_blocks(num, idx, torch.zeros_like(num), torch.zeros_like(idx), BLOCK_SIZE=BLOCK_SIZE,
                                    mask_mod=mask_mod, seq_lengths=(Q_LEN, KV_LEN))


@contextmanager
def planned(model: torch.nn.Module, backend: str) -> Iterator[None]:
    """Run `model`'s document masks with `backend`; flex through the stand-ins above."""
    model.document_attention = backend
    if backend != "flex":
        yield
        return
    saved = llama._FLEX  # the model's (flex_attention, create_block_mask), compiled on first use
    llama._FLEX = (flex_attention, block_mask)
    try:
        yield
    finally:
        llama._FLEX = saved
