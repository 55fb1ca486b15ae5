"""One optimizer step's forward and backward, the one copy the trainer and the planner both run.

The loss is a mean over every target token of the global batch: each rank sums its token losses
and scales them by its FSDP group's ranks (dp, times parallel.cp: CP ranks hold other tokens of the same
rows) / (global target-token count), since FSDP averages gradients over those ranks.
A micro-batch is (inputs, labels), or (inputs, labels, positions) for document-masked packed rows
(`shardlm.data.packing`): the positions go to the model, and masked labels are simply not targets.
The model computes the loss itself (`Transformer.forward(..., labels=)`), `loss_chunk_tokens` tokens of
the output head at a time (train.loss_chunk_tokens): full (tokens, vocab) fp32 logits never exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardlm.config import TrainSection
from shardlm.errors import TrainingError
from shardlm.models.moe import RouterBalance, set_router_balance
from shardlm.train.sdpa import sdpa_context

# (inputs, labels), (inputs, labels, positions), or (inputs, labels, positions or None, real): each (B, T), int64 but
# `real` (bool: False on SFT padding, which the router statistics leave out; `SFTLoader.mark_padding`)
Batch = tuple[torch.Tensor | None, ...]


def set_grad_sync(model: nn.Module, k: int, n_micro: int, mode: str, hsdp: bool) -> None:
    """Before micro-batch `k` of `n_micro`: which gradient collectives its backward runs.

    micro_batch: reduce-scatter after every micro-batch, so gradients stay sharded whatever
    train.grad_accum; with HSDP the cross-replica all-reduce waits for the last micro-batch
    (FSDP2 accumulates the reduce-scattered partial sums until then): most of the inter-node
    traffic is saved at no memory cost.
    step: no gradient collective before the last micro-batch; each rank accumulates the
    *unsharded* gradients of every trainable parameter until then (less traffic, more memory).
    """
    if n_micro == 1:
        return
    last = k == n_micro - 1
    if mode == "step":
        model.set_requires_gradient_sync(last)
    elif hsdp:
        model.set_requires_all_reduce(last)


class RouterLosses:
    """The trainer's side of a mixture of experts' load-balancing (and z-) loss (`models.moe.RouterBalance`).

    Per micro-batch: the statistics every MoE layer recorded are summed over every rank (`all_reduce`: the data
    and context-parallel ranks hold the other tokens of the global micro-batch), so the loss is HF's over the
    whole global micro-batch, whatever the number of ranks; the step's loss term is the mean over its
    micro-batches (coefficient x that mean), and the gradient scale multiplies by `grad_ranks` as the
    cross-entropy's does (FSDP averages gradients over those ranks). The logged figures stay on the device
    until a log step reads them.
    """

    def __init__(self, balance: RouterBalance, grad_ranks: int, all_reduce: Callable[[torch.Tensor], None] | None):
        self.balance, self.grad_ranks, self.all_reduce = balance, grad_ranks, all_reduce
        self.total: torch.Tensor | None = None  # [aux, z, tokens per expert] summed over micro-batches since read
        self.n = 0

    def start(self, n_micro: int, real: torch.Tensor | None = None) -> None:
        """Before a micro-batch's forward; `real`: its (B, T) mask of non-padding tokens (None: no padding)."""
        self.balance.reset()
        self.balance.scale = self.grad_ranks / n_micro
        self.balance.token_mask = None if real is None else real.reshape(-1)

    def after_forward(self) -> None:
        b = self.balance
        b.reduce(self.all_reduce)
        now = torch.cat([b.aux_loss().reshape(1), b.z_loss().reshape(1), b.tokens_per_expert()])
        self.total = now if self.total is None else self.total + now
        self.n += 1

    def read(self) -> dict[str, float]:
        """Since the last read (a log interval): the mean aux and z losses per micro-batch, and how evenly the
        experts were loaded (one host read): load_max (load_min) = the busiest (idlest) expert's tokens / the
        mean; overflow = the share of (token, expert) picks beyond what each expert would take at capacity factor 1 (none is dropped here: this is what a capacity-limited router
        would have dropped)."""
        if self.total is None:
            return {}
        total, n = self.total.tolist(), self.n
        self.total, self.n = None, 0
        counts = total[2:]
        mean = sum(counts) / len(counts)
        rec = {"moe_aux_loss": total[0] / n, "moe_load_max": max(counts) / mean if mean else None,
               "moe_load_min": min(counts) / mean if mean else None,
               "moe_overflow": sum(max(0.0, c - mean) for c in counts) / sum(counts) if mean else None}
        if self.balance.z_coef:
            rec["moe_z_loss"] = total[1] / n
        return rec


def router_losses(model: nn.Module, mc, grad_ranks: int) -> RouterLosses | None:
    """A mixture of experts' `RouterLosses`, attached to every MoE layer of `model` (None for a dense model).
    The statistics are summed over the default process group: every rank (data x context parallel)."""
    if not mc.n_experts:
        return None
    balance = RouterBalance(mc.n_experts, mc.n_experts_per_tok, mc.router_aux_loss_coef, mc.router_z_loss_coef)
    set_router_balance(model, balance)
    return RouterLosses(balance, grad_ranks, dist.all_reduce if dist.is_initialized() else None)


def forward_backward(model: nn.Module, batches: list[Batch], scale: float, device: torch.device,
                     grad_sync: str = "micro_batch", hsdp: bool = False,
                     before_micro_batch: Callable[[int], None] | None = None,
                     loss_chunk_tokens: int = 0, sdpa_backends: tuple[str, ...] | None = None,
                     router: RouterLosses | None = None) -> torch.Tensor:
    """Forward + fp32 token-sum cross-entropy + backward of each micro-batch; the local loss sum.

    `scale` multiplies each micro-batch's loss sum before backward (dp / global target tokens).
    `loss_chunk_tokens`: the head and loss run that many tokens at a time (0: all at once; see
    `Transformer.loss`).
    `before_micro_batch(k)` is the planner's hook (it labels the memory of each micro-batch).
    `sdpa_backends`: the SDPA kernels attention may use, in order (`shardlm.train.sdpa`; None: torch's choice).
    `router`: a mixture of experts' load-balancing loss (`RouterLosses`), added through each micro-batch's
    backward; the returned sum is the cross-entropy's alone.
    """
    loss_sum = torch.zeros((), device=device)
    with sdpa_context(sdpa_backends):  # around backward too (compiled blocks trace their kernel in here)
        for k, batch in enumerate(batches):
            set_grad_sync(model, k, len(batches), grad_sync, hsdp)
            if before_micro_batch is not None:
                before_micro_batch(k)
            x, y = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
            positions = batch[2].to(device, non_blocking=True) if len(batch) > 2 and batch[2] is not None else None
            if router is not None:
                router.start(len(batches), batch[3].to(device, non_blocking=True) if len(batch) > 3 else None)
            loss = model(x, positions, labels=y, loss_chunk_tokens=loss_chunk_tokens)
            if router is not None:
                router.after_forward()
            (loss * scale).backward()
            loss_sum += loss.detach()
            del loss
    return loss_sum


def nonfinite_report(loss_sum: torch.Tensor, params: list) -> str:
    """Which ranks saw a non-finite loss or local gradient (the exceptional path: one all-gather)."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    grads_ok = all(bool(torch.isfinite(g).all()) for g in grads)
    mine = torch.tensor([float(bool(torch.isfinite(loss_sum))), float(grads_ok)])
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    bad_loss = [r for r, v in enumerate(every) if not v[0]]
    bad_grad = [r for r, v in enumerate(every) if not v[1]]

    def ranks(rs: list[int]) -> str:
        return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"

    if bad_loss:
        return f"loss is not finite on {ranks(bad_loss)}"
    if bad_grad:
        return f"gradients are not finite on {ranks(bad_grad)} (loss finite on every rank)"
    return "the gradient norm overflowed (every loss and gradient finite)"


class NonfiniteSteps:
    """train.nonfinite: a non-finite step stops the run with one line, or is skipped and counted (and too many
    in a row stop it)."""

    def __init__(self, t: TrainSection, log: Callable[[str], None]):
        self.t, self.log = t, log
        self.in_row = self.total = 0

    def good(self) -> None:
        self.in_row = 0

    def bad(self, step: int, what: str) -> None:
        """Optimizer step `step` was not applied because of `what` (nonfinite_report's line)."""
        t, where = self.t, f"optimizer step {step}: {what}"
        if t.nonfinite == "stop":
            raise TrainingError(f"non-finite {where}; the update was not applied and the last checkpoint stands. "
                                "Lower train.lr, set train.grad_clip, use train.mixed_precision=fp32, or "
                                "train.nonfinite=skip to drop such steps")
        self.in_row += 1
        self.total += 1
        self.log(f"skipped non-finite {where} ({self.in_row} in a row, {self.total} in all; "
                 "no update, the batch is consumed)")
        if self.in_row >= t.max_skipped_steps:
            raise TrainingError(f"{self.in_row} non-finite steps in a row (train.max_skipped_steps="
                                f"{t.max_skipped_steps}); the last checkpoint stands. Lower train.lr or check the data")


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's share of the global mean loss (all-reduce to get it)
    grad_norm: float  # global, before clipping
    stop: bool  # some rank was asked to stop (SIGTERM or Ctrl-C)
    interrupted: bool  # ... by Ctrl-C: the run ends with exit 130, not 0
    nonfinite: str | None  # what went bad (the update was not applied), or None
    moe: dict | None = None  # a mixture of experts' router figures (RouterLosses.read), on log steps
