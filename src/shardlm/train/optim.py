"""AdamW over trainable parameters, and the warmup + decay learning-rate schedule."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from shardlm.config import TrainSection


def build_optimizer(model: nn.Module, t: TrainSection, device: torch.device) -> torch.optim.AdamW:
    """Decay matrices only (not norms or biases); fused kernels on CUDA. Built after sharding."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                             fused=device.type == "cuda")


Anchor = tuple[int, float]  # (step, factor): the decay restarts from `factor` at `step`


def lr_factor(step: int, t: TrainSection, anchor: Anchor | None = None) -> float:
    """Multiplier of train.lr for optimizer step `step` (0-based).

    Warmup, then decay from 1 to train.min_lr_ratio at train.steps. With an `anchor` (a resume that changed
    train.steps) the decay from the anchor step on runs from the anchor's factor to min_lr_ratio at the new
    train.steps instead, so the learning rate goes on from where it was and never jumps back up.
    """
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return 1.0
    start, top = (t.warmup_steps, 1.0) if anchor is None or step < anchor[0] else anchor
    progress = min((step - start) / max(t.steps - start, 1), 1.0)
    if t.lr_schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.min_lr_ratio + (top - t.min_lr_ratio) * shape


def extended_anchor(step: int, t: TrainSection, saved_steps: int, saved: Anchor | None) -> Anchor | None:
    """The anchor for a run resumed at `step` whose checkpoint was saved under train.steps=`saved_steps`:
    unchanged steps keep the saved anchor; changed ones anchor at `step`, at the factor the saved schedule
    had reached (None during warmup: warmup does not depend on train.steps)."""
    if saved_steps == t.steps or step < t.warmup_steps or t.lr_schedule == "constant":
        return saved
    return step, lr_factor(step, dataclasses.replace(t, steps=saved_steps), saved)


class LRSchedule:
    """train.lr x `lr_factor(step)` written into every param group before each optimizer step (as nanoGPT
    does): the position is one integer, the number of optimizer steps done, so a resume (also one that
    changed train.lr or train.steps) continues the schedule it describes."""

    def __init__(self, opt: torch.optim.Optimizer, t: TrainSection, step: int = 0, anchor: Anchor | None = None):
        self.opt, self.t, self.anchor = opt, t, anchor
        self.set(step)

    def set(self, step: int) -> None:
        self.last_epoch = step  # the name torch's schedulers use for the same number
        for group in self.opt.param_groups:
            group["lr"] = self.t.lr * lr_factor(step, self.t, self.anchor)

    def step(self) -> None:
        """One optimizer step was applied (a skipped non-finite step is not one)."""
        self.set(self.last_epoch + 1)

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.opt.param_groups]


def build_lr_scheduler(opt: torch.optim.Optimizer, t: TrainSection, last_step: int = 0,
                       anchor: Anchor | None = None) -> LRSchedule:
    """The schedule positioned at `last_step` optimizer steps done (0 = fresh; > 0 after a resume)."""
    return LRSchedule(opt, t, last_step, anchor)
