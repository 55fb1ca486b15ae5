"""Activation checkpointing (AC) of transformer blocks, applied before `fully_shard`.

Modes (`train.ac`):

* ``none``: keep every activation (fastest, most memory).
* ``full``: checkpoint every block: only each block's input survives the forward; the block is
  recomputed in backward (about one extra forward per step).
* ``selective``: layer-level selective AC: checkpoint every ``every``-th block, counting from 1
  (blocks ``every-1, 2*every-1, ...``; the torchtitan convention), so ``every=2`` checkpoints half
  of the blocks and ``every=1`` is ``full``.
* ``selective_op``: op-level selective AC in every block (``create_selective_checkpoint_contexts``):
  the outputs of matmuls and attention (``aten.mm/addmm/bmm``, ``_scaled_dot_product_*``) are saved,
  everything else (norms, RoPE, SiLU, products, casts) is recomputed. Cheap to recompute, a good share
  of the memory saved.

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

from functools import partial
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

AC_MODES = ("none", "full", "selective", "selective_op")


def _sac_save_ops() -> set:
    """The aten ops whose outputs op-level selective AC keeps (those that exist in this torch)."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"]
    ops = set()
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            ops.add(packet.default)
    return ops


def _sac_context_fn() -> Callable[[], Any]:
    try:
        from torch.utils.checkpoint import (
            CheckpointPolicy,
            create_selective_checkpoint_contexts,
        )
    except ImportError as e:  # pragma: no cover - present since torch 2.4/2.5
        raise RuntimeError("train.ac=selective_op needs torch.utils.checkpoint.create_selective_checkpoint_contexts "
                           "(torch >= 2.5); use ac=full or ac=selective") from e
    save = _sac_save_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return partial(create_selective_checkpoint_contexts, policy)


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
