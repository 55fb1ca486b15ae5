"""Activation checkpointing (AC) of transformer blocks, applied before `fully_shard`.

Modes (`train.ac`):

* ``none``: keep every activation (fastest, most memory).
* ``full``: checkpoint every block: only each block's input survives the forward; the block is
  recomputed in backward (about one extra forward per step).
* ``selective``: layer-level selective AC: checkpoint every ``every``-th block, counting from 1
  (blocks ``every-1, 2*every-1, ...``; the torchtitan convention), so ``every=2`` checkpoints half
  of the blocks and ``every=1`` is ``full``.
* ``selective_op``: op-level selective AC in every block (``create_selective_checkpoint_contexts``),
  torchtitan's per-op policy: the outputs of attention (``_scaled_dot_product_*``) and of every other matmul
  (``aten.mm``/``addmm`` number 1, 3, 5, ... of the block: in a Llama block q, v, gate and down; k, o and up
  are recomputed) are saved, and the scalar ``aten.max`` (float8 scales); everything else (norms, RoPE, SiLU,
  products, casts) is recomputed. Each block's forward and its recomputation count their matmuls afresh, so
  they agree on which are saved. Torchtitan's measured memory (benchmarks/plan_vs_published.py) is that of
  this policy; saving every matmul would keep ~1.6x the activations of a Llama block for one matmul less.

Parameter names do not change. `checkpoint_wrapper` would put each block behind a
`_checkpoint_wrapped_module.` prefix (state-dict keys, `named_parameters`, LoRA/HF name mapping);
instead each block's class is swapped in place for a dynamically made subclass whose `forward`
runs the original `forward` under non-reentrant `torch.utils.checkpoint.checkpoint` (the same trick
`fully_shard` uses to make `FSDPBlock`). `model.layers[i]` stays the same object, with the same
submodules and parameters; `fully_shard` then wraps it as usual, so FSDP's unshard/reshard hooks sit
outside the checkpointed region and recomputation in backward runs on the already unsharded
parameters (FSDP's pre-backward hook gathers them before the block's saved tensors are unpacked).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

AC_MODES = ("none", "full", "selective", "selective_op")


def _ops(names: list[str]) -> set:
    """The `.default` overloads of the aten ops with these names that exist in this torch."""
    ops = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            ops.add(packet.default)
    return ops


def _sac_ops() -> tuple[set, set]:
    """(matmul ops: every other one saved, ops always saved) of op-level selective AC."""
    return _ops(["mm", "addmm"]), _ops(["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                                        "_scaled_dot_product_cudnn_attention",
                                        "_scaled_dot_product_flash_attention_for_cpu", "max"])


def _sac_context_fn() -> Callable[[], Any]:
    """A new pair of (forward, recompute) contexts per block call, sharing fresh matmul counters."""
    try:
        from torch.utils.checkpoint import (
            CheckpointPolicy,
            create_selective_checkpoint_contexts,
        )
    except ImportError as e:  # pragma: no cover - present since torch 2.4/2.5
        raise RuntimeError("train.ac=selective_op needs torch.utils.checkpoint.create_selective_checkpoint_contexts "
                           "(torch >= 2.5); use ac=full or ac=selective") from e
    matmuls, always = _sac_ops()

    def contexts():
        count = {False: 0, True: 0}  # matmuls seen in the forward / in the recomputation of this block call

        def policy(ctx, op, *args, **kwargs):
            if op in matmuls:
                count[ctx.is_recompute] += 1
                save = count[ctx.is_recompute] % 2 == 1
            else:
                save = op in always
            return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return contexts


class CheckpointedBlock:
    """Mixin put in front of a block's class: `forward` = checkpointed original `forward`."""

    _ac_context_fn: Callable[[], Any] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        fwd = super().forward  # the original block's forward (next class in the MRO)
        if not torch.is_grad_enabled():  # inference / generation: nothing to save, nothing to recompute
            return fwd(*args, **kwargs)
        extra = {"context_fn": self._ac_context_fn} if self._ac_context_fn is not None else {}
        return checkpoint(fwd, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


_classes: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    if cls not in _classes:
        _classes[cls] = type(f"Checkpointed{cls.__name__}", (CheckpointedBlock, cls), {})
    return _classes[cls]


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module, CheckpointedBlock)


def checkpoint_block(block: nn.Module, context_fn: Callable[[], Any] | None = None) -> nn.Module:
    """Make `block` run its forward under non-reentrant AC, in place (names and parameters unchanged)."""
    if is_checkpointed(block):
        raise ValueError(f"{type(block).__name__} is already activation-checkpointed")
    if isinstance(block, FSDPModule):
        raise ValueError("apply_ac must run before fully_shard (FSDP's hooks must stay outside the checkpoint)")
    block.__class__ = _checkpointed_class(type(block))
    if context_fn is not None:
        block._ac_context_fn = context_fn
    return block


def apply_ac(model: nn.Module, mode: str = "none", every: int = 2) -> list[int]:
    """Activation-checkpoint the blocks of `model.layers` per `mode` (see the module docstring).

    Call it after LoRA and before `fully_shard`. Returns the indices of the checkpointed blocks.
    """
    if mode not in AC_MODES:
        raise ValueError(f"train.ac must be one of {', '.join(AC_MODES)}, got {mode!r}")
    if mode == "none":
        return []
    if every < 1:
        raise ValueError(f"selective AC needs every >= 1, got {every}")
    context_fn = _sac_context_fn() if mode == "selective_op" else None
    chosen = []
    for i, block in enumerate(model.layers):
        if mode == "selective" and (i + 1) % every:
            continue
        model.layers[i] = checkpoint_block(block, context_fn)  # same object, class swapped
        chosen.append(i)
    return chosen
