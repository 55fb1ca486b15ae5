"""A sparse mixture-of-experts feed-forward (Qwen3-MoE, Mixtral, Qwen2-MoE's shared expert), plain PyTorch.

    router (`gate`: Linear dim -> n_experts) -> softmax in fp32 -> top-k (renormalised with norm_topk_prob:
    Qwen3-MoE's option, always on for Mixtral, whose "softmax over the top-k" is the same numbers)
    -> each token's k experts (SwiGLU each) -> their outputs weighted by the top-k probabilities
    [+ a shared expert every token passes through, scaled by sigmoid(shared_expert_gate(x)): Qwen2-MoE]

Experts are stacked tensors `experts.gate_proj` / `up_proj` (n_experts, moe_ffn_dim, dim) and `down_proj`
(n_experts, dim, moe_ffn_dim): to `fully_shard` they are parameters like any other, sharded on dim 0, i.e.
by expert, and an HF checkpoint's per-expert tensors are rows of them. The checkpoint layout is therefore
already the one an expert-parallel mesh dimension would keep (docs/moe.md).

Dispatch: the (token, expert) pairs are sorted by expert (one argsort, no per-token Python loop); each
expert's rows are contiguous, so the three projections are grouped matmuls: `F.grouped_mm` on CUDA in bf16
(`shardlm._torch_compat.grouped_mm`), else one matmul per expert over its rows (exact everywhere). The
outputs are scaled by their routing weights and summed back per token with one `index_add_`.

Load balancing (training only): with `router_balance` set on the model, every MoE layer records how many
tokens each expert got and the summed router probabilities, and attaches HF's load-balancing loss (Switch
Transformer eqs. 4-6 over all layers at once, `load_balancing_loss_func`) and optionally the router z-loss
to its output's backward: the trainer sums the counts over every rank first (`RouterBalance.reduce`), so the
loss is that of the whole global micro-batch, on 1 rank or on 64. Nothing here imports torch.distributed:
the trainer hands in the reduction.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardlm._torch_compat import grouped_mm, has_grouped_mm, is_fake


def grouped_linear(x: torch.Tensor, w: torch.Tensor, sizes: list[int] | None, offsets: torch.Tensor | None) -> torch.Tensor:
    """Rows of x (sorted by group, `sizes[g]` rows for group g) times w[g]^T: (n, in) x (G, out, in) -> (n, out).

    `offsets` (int32 cumulative counts, given where the grouped kernel may run) selects `F.grouped_mm`; without
    it, one `F.linear` per group that has rows (`w.unbind(0)`: its backward stacks the groups' gradients once).
    """
    if offsets is not None:
        return grouped_mm(x, w.transpose(-2, -1), offsets)
    if sizes is not None and len(set(sizes)) == 1:  # even groups (the planner's fake step): one batched matmul
        return torch.bmm(x.view(len(sizes), sizes[0], x.shape[-1]), w.transpose(-2, -1)).flatten(0, 1)
    ws = w.unbind(0)
    parts = [F.linear(chunk, ws[g]) for g, chunk in enumerate(x.split(sizes)) if chunk.shape[0]]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[1])


def _dense(w: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A stacked weight held flat `(n_experts * out, in)`, quantised (an NF4Tensor: dequantised) or not, as
    `shape` in `dtype`."""
    full = w.get_original_weight() if hasattr(w, "get_original_weight") else w
    return full.view(shape).to(dtype)


class _FrozenStacked(torch.autograd.Function):
    """`grouped_linear` against a frozen stacked weight held flat and quantised (QLoRA of the experts): dequantised
    in the forward and again in the backward for the input's gradient, so autograd keeps the 4-bit tensor, not a
    bf16 copy of every layer's experts until the backward (torchao's `linear_nf4` does the same for a linear)."""

    @staticmethod
    def forward(ctx, x, w, shape, sizes, offsets):  # noqa: D401
        ctx.w, ctx.shape, ctx.sizes, ctx.offsets = w, shape, sizes, offsets
        return grouped_linear(x, _dense(w, shape, x.dtype), sizes, offsets)

    @staticmethod
    def backward(ctx, grad):
        w = _dense(ctx.w, ctx.shape, grad.dtype)
        return grouped_linear(grad, w.transpose(1, 2), ctx.sizes, ctx.offsets), None, None, None, None


def use_grouped_mm(x: torch.Tensor) -> bool:
    """Whether the grouped kernel runs for activations x (CUDA, bf16, a torch that has it)."""
    if not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    return has_grouped_mm()


class ExpertFactors(nn.ParameterDict):
    """`lora_A` or `lora_B` of stacked experts: one (n_experts, ...) parameter per adapted projection, each
    saying how it starts (`Transformer.init_weights` asks the module that owns a parameter)."""

    def __init__(self, params: dict[str, nn.Parameter], specs: dict[str, tuple]):
        super().__init__(params)
        self.specs = specs

    def init_spec(self, pname: str) -> tuple:
        return self.specs[pname]


PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Experts(nn.Module):
    """n_experts SwiGLU experts as three stacked parameters (no `.weight`: HF's fused layout names them so too).

    LoRA (`add_lora`): per adapted projection P, `lora_A.P` (n_experts, r, in) and `lora_B.P` (n_experts, out, r):
    expert e's P is W[e] + B[e] @ A[e] * alpha / r, as a LoRALinear per expert would be; the factors are stacked
    like the weights, so FSDP shards them by expert too.
    """

    def __init__(self, n_experts: int, dim: int, ffn_dim: int):
        super().__init__()
        self.n_experts = n_experts
        self.gate_proj = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.up_proj = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        # projections stored flat `(n_experts * out, in)` (a QLoRA base in NF4: `shardlm.quant.nf4.apply_nf4`) -> their
        # (n_experts, out, in) shape, which the files, the init and the forward use
        self.logical_shapes: dict[str, tuple[int, ...]] = {}
        self.lora_A: ExpertFactors | None = None
        self.lora_B: ExpertFactors | None = None
        self.lora_scaling = 0.0
        self.lora_dropout: nn.Module = nn.Identity()

    def add_lora(self, projections: list[str], r: int, alpha: float, dropout: float, a_spec: Callable[[int], tuple]) -> None:
        """Adapters on `projections` (a subset of PROJECTIONS); `a_spec(in_features)` is lora_A's init spec."""
        if self.lora_A is not None:
            raise ValueError("these experts already have LoRA adapters")
        w = {p: getattr(self, p) for p in projections}
        a = {p: nn.Parameter(torch.empty(self.n_experts, r, t.shape[2], device=t.device, dtype=t.dtype))
             for p, t in w.items()}
        b = {p: nn.Parameter(torch.empty(self.n_experts, t.shape[1], r, device=t.device, dtype=t.dtype))
             for p, t in w.items()}
        self.lora_A = ExpertFactors(a, {p: a_spec(t.shape[2]) for p, t in w.items()})
        self.lora_B = ExpertFactors(b, {p: ("zeros",) for p in w})
        self.lora_scaling = alpha / r
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def drop_lora(self) -> None:
        """Forget the adapters (after `shardlm.lora.merge_lora` folded them into the weights)."""
        self.lora_A = self.lora_B = None
        self.lora_dropout = nn.Identity()

    def _proj(self, x: torch.Tensor, which: str, sizes: list[int] | None, offsets: torch.Tensor | None) -> torch.Tensor:
        w = getattr(self, which)
        if which in self.logical_shapes:
            y = _FrozenStacked.apply(x, w, self.logical_shapes[which], sizes, offsets)
        else:
            y = grouped_linear(x, w, sizes, offsets)
        if self.lora_A is not None and which in self.lora_A:
            h = grouped_linear(self.lora_dropout(x), self.lora_A[which], sizes, offsets)
            y = y + grouped_linear(h, self.lora_B[which], sizes, offsets) * self.lora_scaling
        return y

    def _swiglu(self, xs: torch.Tensor, sizes: list[int] | None, offsets: torch.Tensor | None) -> torch.Tensor:
        h = F.silu(self._proj(xs, "gate_proj", sizes, offsets)) * self._proj(xs, "up_proj", sizes, offsets)
        return self._proj(h, "down_proj", sizes, offsets)

    @torch.compiler.disable
    def _looped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The per-expert loop, outside torch.compile: its row counts are read on the host and differ every step
        (compiled, each new set of counts would be a recompile)."""
        return self._swiglu(xs, counts.tolist(), None)

    def forward(self, x: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (N, dim); expert, weight (N, k): each token's experts and their weights -> (N, dim)."""
        n, k = expert.shape
        flat = expert.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order
        token = order // k
        xs = x[token]
        if is_fake(x):  # the planner's fake step: no routing to read; every expert gets its even share of rows
            y = self._swiglu(xs, [n * k // self.n_experts + (e < n * k % self.n_experts) for e in range(self.n_experts)],
                             None)
        else:
            counts = torch.bincount(flat, minlength=self.n_experts)
            if use_grouped_mm(xs):
                y = self._swiglu(xs, None, torch.cumsum(counts, 0, dtype=torch.int32))
            else:
                y = self._looped(xs, counts)
        y = y * weight.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


class _SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP every token passes through."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RouterBalance:
    """One forward's routing statistics and the load-balancing (and z-) loss they imply.

    HF's loss (`load_balancing_loss_func`): over every MoE layer's R rows at once (R = layers x tokens),
    f_e = (top-k picks of expert e) / R and P_e = (summed router probability of e) / R; the loss is
    n_experts * sum_e f_e * P_e. The z-loss (ST-MoE) is sum(logsumexp(router logits)^2) / R.
    A layer's forward records its local counts, probability sums and z sums (recorded again, identically, when
    activation checkpointing recomputes it), padding tokens left out (`token_mask`: HF's attention mask); `reduce(all_reduce)` sums them over the ranks that share the
    micro-batch; the backward then gives each layer's probabilities the gradient of
    `scale * (aux_coef * loss + z_coef * z)`, `scale` set by the trainer for its normalisation.
    """

    def __init__(self, n_experts: int, top_k: int, aux_coef: float, z_coef: float = 0.0):
        self.n_experts, self.top_k, self.aux_coef, self.z_coef = n_experts, top_k, aux_coef, z_coef
        self.scale = 1.0
        # this micro-batch's local tokens (flat, bool): False = padding, left out of the statistics as HF's attention
        # mask leaves it out; None: every token counts. Set by the trainer before the forward.
        self.token_mask: torch.Tensor | None = None
        self.reset()

    def reset(self) -> None:
        self.counts: dict[int, torch.Tensor] = {}
        self.prob_sums: dict[int, torch.Tensor] = {}
        self.z_sums: dict[int, torch.Tensor] = {}
        self._total: torch.Tensor | None = None  # [counts (E), prob sums (E), z sum] over layers and ranks

    def record(self, layer: int, expert: torch.Tensor, prob_sum: torch.Tensor, z_sum: torch.Tensor) -> None:
        """Layer `layer`'s top-k picks (N, k) and its summed probabilities and z (kept detached)."""
        with torch.no_grad():
            self.counts[layer] = torch.bincount(expert.reshape(-1), minlength=self.n_experts).float()
        self.prob_sums[layer], self.z_sums[layer] = prob_sum.detach(), z_sum.detach()

    def local(self) -> torch.Tensor:
        """This rank's [counts, prob sums, z sum] summed over the layers (2E + 1 floats)."""
        layers = sorted(self.counts)
        if not layers:
            raise RuntimeError("no MoE layer ran a forward since the last reset()")
        return torch.cat([torch.stack([self.counts[i] for i in layers]).sum(0),
                          torch.stack([self.prob_sums[i] for i in layers]).sum(0),
                          torch.stack([self.z_sums[i] for i in layers]).sum().reshape(1)])

    def reduce(self, all_reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        """Sum the statistics over the ranks sharing this micro-batch (`all_reduce` sums a tensor in place;
        None: this rank holds the whole micro-batch). Call after the forward, before the backward."""
        total = self.local()
        if all_reduce is not None:
            all_reduce(total)
        self._total = total

    def _parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._total is None:
            self.reduce()
        e = self.n_experts
        counts, probs, z = self._total[:e], self._total[e:2 * e], self._total[2 * e]
        rows = (counts.sum() / self.top_k).clamp_min(1.0)  # 0 only if every token was padding: no loss, not NaN
        return counts, probs, z, rows

    def aux_loss(self) -> torch.Tensor:
        """HF's load-balancing loss of the (reduced) micro-batch (no coefficient), a detached scalar."""
        counts, probs, _, rows = self._parts()
        return self.n_experts * (counts / rows * probs / rows).sum()

    def z_loss(self) -> torch.Tensor:
        _, _, z, rows = self._parts()
        return z / rows

    def tokens_per_expert(self) -> torch.Tensor:
        """Top-k picks per expert over the layers and ranks (E,)."""
        return self._parts()[0]

    def grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """d(scale * (aux_coef * aux + z_coef * z)) / d(a layer's local probability sums, its local z sum)."""
        counts, _, _, rows = self._parts()
        g_probs = self.scale * self.aux_coef * self.n_experts * (counts / rows) / rows
        g_z = torch.full((), self.scale * self.z_coef, device=rows.device) / rows
        return g_probs, g_z


class _AttachBalance(torch.autograd.Function):
    """Identity on the layer's output; in backward, the balance loss's gradient enters the router through the
    probability sums and the z sum (known only then: they need every layer's and every rank's counts)."""

    @staticmethod
    def forward(ctx, out, prob_sum, z_sum, balance):  # noqa: D401
        ctx.balance = balance
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        g_probs, g_z = ctx.balance.grads()
        return grad_out, g_probs, g_z, None


@torch.compiler.disable
def _attach(out: torch.Tensor, layer: int, logits: torch.Tensor, probs: torch.Tensor, expert: torch.Tensor,
            balance: RouterBalance) -> torch.Tensor:
    z = torch.logsumexp(logits.float(), -1).pow(2)
    probs = probs.float()
    if (mask := balance.token_mask) is not None:  # padding: out of the counts, the probability sums and z
        if mask.shape != (expert.shape[0],):
            raise ValueError(f"RouterBalance.token_mask has shape {tuple(mask.shape)}, the layer routed "
                             f"{expert.shape[0]} tokens")
        expert, keep = expert[mask], mask.to(probs.dtype)
        probs, z = probs * keep[:, None], z * keep
    prob_sum, z = probs.sum(0), z.sum()  # once: recorded and attached
    balance.record(layer, expert, prob_sum, z)
    return _AttachBalance.apply(out, prob_sum, z, balance)


class MoE(nn.Module):
    """The sparse feed-forward of one block: router, stacked experts, optional shared expert."""

    router_balance: RouterBalance | None = None  # set by the trainer on every MoE layer (None: no aux loss)

    def __init__(self, dim: int, n_experts: int, top_k: int, ffn_dim: int, norm_topk_prob: bool,
                 shared_ffn_dim: int = 0, layer: int = 0):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"n_experts_per_tok must be in [1, n_experts={n_experts}], got {top_k}")
        self.top_k, self.norm_topk_prob, self.layer = top_k, norm_topk_prob, layer
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(n_experts, dim, ffn_dim)
        self.shared_expert = _SharedExpert(dim, shared_ffn_dim) if shared_ffn_dim else None
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if shared_ffn_dim else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits (N, E), fp32 probabilities (N, E), top-k experts (N, k), their weights (N, k) fp32)."""
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        weight, expert = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weight = weight / weight.sum(-1, keepdim=True)
        return logits, probs, expert, weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, probs, expert, weight = self.route(x)
        y = self.experts(x, expert, weight.to(x.dtype))
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        balance = self.router_balance
        if balance is not None and torch.is_grad_enabled():
            y = _attach(y, self.layer, logits, probs, expert, balance)
        return y.reshape(shape)


def expert_param_count(dim: int, n_experts: int, ffn_dim: int, shared_ffn_dim: int) -> int:
    """Parameters of one MoE layer: router, experts, shared expert and its gate."""
    shared = 3 * dim * shared_ffn_dim + dim if shared_ffn_dim else 0
    return n_experts * dim + n_experts * 3 * dim * ffn_dim + shared


def is_expert_param(name: str) -> bool:
    """A stacked expert parameter (`...experts.gate_proj` etc.): rows are experts."""
    return name.rsplit(".", 2)[-2:-1] == ["experts"]


def set_router_balance(model: nn.Module, balance: RouterBalance | None) -> int:
    """Attach `balance` to every MoE layer of `model` (None detaches); returns how many there are."""
    n = 0
    for m in model.modules():
        if isinstance(m, MoE):
            m.router_balance = balance
            n += 1
    return n

