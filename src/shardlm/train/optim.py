"""AdamW over trainable parameters, and the warmup + decay learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

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


def lr_factor(step: int, t: TrainSection) -> float:
    """Multiplier of train.lr for optimizer step `step` (0-based)."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return 1.0
    decay_steps = max(t.steps - t.warmup_steps, 1)
    progress = min((step - t.warmup_steps) / decay_steps, 1.0)
    if t.lr_schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.min_lr_ratio + (1.0 - t.min_lr_ratio) * shape


def build_lr_scheduler(opt: torch.optim.Optimizer, t: TrainSection, last_step: int = 0) -> LambdaLR:
    """The schedule positioned at `last_step` optimizer steps done (0 = fresh; > 0 after a resume)."""
    for group in opt.param_groups:  # the schedule follows train.lr, also after a resume that changed it
        group["initial_lr"] = t.lr
    sched = LambdaLR(opt, lambda step: lr_factor(step, t))
    if last_step:
        sched.last_epoch = last_step
        for group in opt.param_groups:
            group["lr"] = t.lr * lr_factor(last_step, t)
        sched._last_lr = [g["lr"] for g in opt.param_groups]
    return sched
