"""A Llama-family decoder in plain PyTorch.

Covers Llama 2/3/3.1 (RoPE with Llama-3.1 frequency scaling), Mistral, Qwen2 (q/k/v bias) and
Qwen3 (per-head q/k RMSNorm), and their mixtures of experts (Qwen3-MoE, Mixtral, Qwen2-MoE: the sparse
feed-forward of `shardlm.models.moe` in the blocks `ModelConfig.is_moe_layer` names): RMSNorm, rotary embeddings, grouped-query attention through
`scaled_dot_product_attention`, SwiGLU, optional tied embeddings. Module names follow Hugging
Face's (`layers.N.self_attn.q_proj`, ...) so checkpoints map one-to-one and LoRA targets read
the same as in peft.

Document masking for packed rows: `forward(tokens, positions)` with each token's position within
its document makes every document of a row attend only to itself, at its own RoPE positions, as if
it ran alone. The mask goes to the blocks as an argument (a bool tensor, or flex attention's
`BlockMask` on CUDA: `document_attention_backend`), so FSDP, activation checkpointing and
torch.compile of blocks see it like any other input. Without positions nothing changes: causal SDPA.

Decoding: `forward(tokens, cache=KVCache(...))` appends the tokens' keys and values to a
preallocated per-layer cache and attends over everything cached, so after the prompt (the prefill)
each new token costs one token's forward, however long the prefix. Rows may be left-padded; the
cache knows each row's padding, gives every token its own position and keeps padding unread.

Training loss: `forward(tokens, labels=labels)` returns the fp32 cross-entropy summed over the target
tokens instead of logits. With `loss_chunk_tokens` the output head and the loss run that many tokens at a
time, each chunk under activation checkpointing: no more than (chunk, vocab) logits exist at once, and the
loss and gradients are those of the whole (B, T, vocab) logits. Inside `forward` on purpose: under FSDP the
head's weight is unsharded only within the root module's forward and backward.

Nothing here knows about distribution: the model is built on the `meta` device, sharded from
outside (`shardlm.parallel`), materialised with `to_empty`, then `init_weights()` fills it.
"""

from __future__ import annotations

import importlib.util
import math
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardlm.models.moe import MoE, expert_param_count

IGNORE_INDEX = -100  # a label that is not a target (cross_entropy's default; shardlm.data uses the same)


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency scaling (HF `rope_scaling` with `rope_type = "llama3"`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    ffn_dim: int
    n_kv_heads: int | None = None
    head_dim: int | None = None  # default dim // n_heads (Qwen3 sets it explicitly)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048  # length of the RoPE table; the trainer sets it to data.seq_len
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    # Mixture of experts (models/moe.py); n_experts = 0: every block has the dense SwiGLU of ffn_dim.
    n_experts: int = 0
    n_experts_per_tok: int = 0  # top-k
    moe_ffn_dim: int = 0  # each expert's SwiGLU hidden size
    norm_topk_prob: bool = True  # renormalise the top-k probabilities (Mixtral: always; Qwen3-MoE: its config)
    moe_layer_step: int = 1  # HF decoder_sparse_step: block i is sparse when (i + 1) % step == 0 ...
    dense_layers: tuple[int, ...] = ()  # ... and i is not one of these (HF mlp_only_layers)
    shared_expert_ffn_dim: int = 0  # Qwen2-MoE's shared expert (0: none)
    router_aux_loss_coef: float = 0.0  # HF's load-balancing loss coefficient (training only)
    router_z_loss_coef: float = 0.0  # router z-loss (ST-MoE); none of the HF families sets one

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        if self.n_experts:
            if not 1 <= self.n_experts_per_tok <= self.n_experts or self.moe_ffn_dim < 1 or self.moe_layer_step < 1:
                raise ValueError(f"a mixture of experts needs 1 <= n_experts_per_tok <= n_experts ({self.n_experts}), "
                                 f"moe_ffn_dim >= 1 and moe_layer_step >= 1; got {self.n_experts_per_tok}, "
                                 f"{self.moe_ffn_dim}, {self.moe_layer_step}")

    def is_moe_layer(self, i: int) -> bool:
        """Whether block i has the sparse MoE feed-forward (HF's rule: decoder_sparse_step, mlp_only_layers)."""
        return bool(self.n_experts) and i not in self.dense_layers and (i + 1) % self.moe_layer_step == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """Exact parameter count, computed from the shapes (no model needed). `active`: what one token runs
        through (its top-k experts of each MoE layer, not all of them)."""
        hd, q, kv = self.head_dim, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = self.dim * q + 2 * self.dim * kv + q * self.dim
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * hd
        n_moe = self.n_moe_layers
        experts = self.n_experts_per_tok if active else self.n_experts
        moe = expert_param_count(self.dim, experts, self.moe_ffn_dim, self.shared_expert_ffn_dim)
        if active:
            moe += (self.n_experts - experts) * self.dim  # the router scores every expert
        blocks = self.n_layers * (attn + 2 * self.dim) + (self.n_layers - n_moe) * 3 * self.dim * self.ffn_dim
        emb = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else emb
        total = blocks + n_moe * moe + self.dim + emb + head
        return total - emb if exclude_embedding else total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus 12*L*H*Dh*T for attention (PaLM, App. B); N counts
        the parameters a token runs through (a mixture of experts: its top-k experts, `num_params(active=True)`)."""
        n = self.num_params(exclude_embedding=True, active=True)
        if self.tie_embeddings:
            n += self.vocab_size * self.dim  # the output projection still runs
        return 6.0 * n + 12.0 * self.n_layers * self.n_heads * self.head_dim * seq_len


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, exactly as Llama/HF do."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama-3.1 scaling when configured (same formula as HF)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for `max_seq_len` positions (non-persistent buffers: recomputed, never saved)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("cos", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        inv_freq = rope_inv_freq(self.cfg).to(self.cos.device)
        self.inv_freq.copy_(inv_freq)
        t = torch.arange(self.cfg.max_seq_len, device=inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {seq_len} tokens exceeds the RoPE table ({self.cfg.max_seq_len})")
        return self.cos[:seq_len], self.sin[:seq_len]

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (B, T, D) at each token's own position: computed as the table is, for any position
        (a row that starts deep inside a long document goes past the table; no host sync to check)."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); cos/sin: (T, D), or (B, T, D) per token (`RotaryEmbedding.at`)."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


# -- document masking -------------------------------------------------------------------------------
DOCUMENT_BACKENDS = ("flex", "sdpa-mask")


def document_segments(positions: torch.Tensor) -> torch.Tensor:
    """(B, T) segment ids: how many documents start at or before each token (0: a row's leading part
    of a document that started before the row)."""
    return (positions == 0).cumsum(-1)


def document_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool for SDPA: query t may read key s when s <= t and both are in one document."""
    t = segments.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segments.device).tril()
    return (segments[:, None, :, None] == segments[:, None, None, :]) & causal


def document_mask_mod(segments: torch.Tensor) -> Callable:
    """The same mask as flex attention's `mask_mod(b, h, q_idx, kv_idx)`."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (segments[b, q_idx] == segments[b, kv_idx]) & (kv_idx <= q_idx)

    return mask_mod


_FLEX: tuple[Callable, Callable] | None = None


def _flex_fns() -> tuple[Callable, Callable]:
    """(flex_attention, create_block_mask), each torch.compile'd once (uncompiled, flex attention
    materialises the scores; inside a compiled block dynamo inlines it)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        _FLEX = (torch.compile(flex_attention), torch.compile(create_block_mask))
    return _FLEX


@lru_cache(maxsize=None)
def _flex_importable() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def document_attention_backend(device: torch.device | str) -> tuple[str, str]:
    """("flex" | "sdpa-mask", why): how the model masks documents on `device` (for the startup line).

    flex: flex attention compiled to Triton on CUDA, a block-sparse mask built once per forward.
    sdpa-mask: SDPA with a dense (B, 1, T, T) bool mask, exact everywhere (O(T^2) memory, no flash kernel).
    """
    device, dense = torch.device(device), "SDPA with a dense (B, 1, T, T) mask"
    if device.type != "cuda":
        return "sdpa-mask", f"{dense}: flex attention is used on CUDA only (here {device.type})"
    if not _flex_importable():
        return "sdpa-mask", f"{dense}: torch {torch.__version__} has no flex attention"
    if importlib.util.find_spec("triton") is None:
        return "sdpa-mask", f"{dense}: flex attention needs triton, which is not installed"
    return "flex", "compiled flex attention with a block-sparse document mask"


def document_mask(positions: torch.Tensor, backend: str) -> Any:
    """What `Block.forward` takes as `mask` for rows with these positions: a bool tensor or a `BlockMask`."""
    if backend not in DOCUMENT_BACKENDS:
        raise ValueError(f"document attention backend must be one of {', '.join(DOCUMENT_BACKENDS)}, got {backend!r}")
    segments = document_segments(positions)
    if backend == "sdpa-mask":
        return document_causal_mask(segments)
    b, t = segments.shape
    return _flex_fns()[1](document_mask_mod(segments), b, None, t, t, device=segments.device)

# -- KV cache (decoding) ----------------------------------------------------------------------------
class LayerKV:
    """One layer's slice of a `KVCache`: (B, n_kv_heads, max_len, head_dim) keys and values."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' (B, H_kv, T, D) keys and values after what is cached; return every cached
        column up to and including them."""
        c = self.cache
        end = c.length + k.shape[2]
        if self.k is None:
            shape = (c.batch_size, k.shape[1], c.max_len, k.shape[3])
            self.k = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.v = torch.zeros(shape, dtype=v.dtype, device=v.device)
        self.k[:, :, c.length:end] = k
        self.v[:, :, c.length:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """The keys and values of every token a batch has run through the model so far, for decoding.

    Per layer, (batch_size, n_kv_heads, max_len, head_dim) keys and values, allocated once at the first
    forward in that forward's dtype and device (under FSDP: the compute dtype). `length` columns are
    filled; `forward(tokens, cache=cache)` with (B, T) tokens writes columns length .. length+T-1 and
    then advances `length` by T (past `max_len`: ValueError; start a new cache).

    `pad[b]` (default 0) leading columns of row b are left padding: no later token reads them, and the
    token in column s of row b has position s - pad[b]. So a row's logits are those of the row alone.

    A plain object on purpose, not a dataclass or container: FSDP's input casting rebuilds those and would
    hand the blocks a copy; this one reaches them untouched.
    """

    def __init__(self, batch_size: int, max_len: int, n_layers: int, pad: torch.Tensor | None = None):
        if pad is not None and (pad.shape != (batch_size,) or bool((pad < 0).any()) or bool((pad >= max_len).any())):
            raise ValueError(f"pad must hold one count in [0, max_len) per row, got {pad.tolist()}")
        self.batch_size, self.max_len, self.length = batch_size, max_len, 0
        self.pad = pad.to(torch.int64) if pad is not None and bool(pad.any()) else None
        self.layers = [LayerKV(self) for _ in range(n_layers)]

    def _pad_on(self, device: torch.device) -> torch.Tensor:
        if self.pad.device != device:
            self.pad = self.pad.to(device)  # once: the counts stay on the model's device
        return self.pad

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """(B, t) RoPE positions of the next t tokens (0 for padding)."""
        cols = torch.arange(self.length, self.length + t, device=device).expand(self.batch_size, t)
        if self.pad is None:
            return cols
        return (cols - self._pad_on(device)[:, None]).clamp_min(0)

    def attention_mask(self, t: int, device: torch.device) -> torch.Tensor | None:
        """(B, 1, t, length+t) bool mask of the next t tokens over every cached column (True: may read), or
        None where `Attention` needs none: causal over the first tokens, or one token reading every column."""
        if self.pad is None and (self.length == 0 or t == 1):
            return None
        q = torch.arange(self.length, self.length + t, device=device)[:, None]
        s = torch.arange(self.length + t, device=device)[None, :]
        mask = (s <= q)[None, None].expand(self.batch_size, 1, t, self.length + t)
        if self.pad is None:
            return mask
        # A padding token reads only itself: no row of the attention is empty (that would give NaN).
        readable = (s >= self._pad_on(device)[:, None])[:, None, None, :] | (s == q)[None, None]
        return mask & readable

    def advance(self, t: int) -> None:
        self.length += t


class Attention(nn.Module):
    # parallel.cp: the CP group's exchange (`shardlm.parallel.cp.Ulysses`), set from outside; None: the whole
    # sequence is here. A plain attribute, not a module: the model never calls torch.distributed itself.
    context_parallel: Any = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, q, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, kv, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any = None,
                kv: LayerKV | None = None) -> torch.Tensor:
        """mask: None (causal), a (B, 1, T, S) bool tensor (True: may attend) or a flex `BlockMask`.

        kv: this layer's `KVCache` slice: the new keys/values are appended and the queries read every cached
        column (S = cached + T); mask None then means causal for a first chunk, everything for one token.
        """
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cp = self.context_parallel
        if cp is not None:  # this rank's T / cp tokens -> the whole sequence for H / cp heads (cos, sin, mask: whole)
            q, k, v = cp.qkv_to_heads(q, k, v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            k, v = kv.update(k, v)
        if mask is not None and not isinstance(mask, torch.Tensor):  # flex: the kernel does GQA itself
            y = _flex_fns()[0](q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
            return self._out(y, b, t)
        gqa = {}
        if q.shape[1] != k.shape[1]:  # GQA: query head h reads kv head h // n_rep
            if kv is not None:  # SDPA maps the heads itself: no copy of a cache that grows with the prefix
                gqa = {"enable_gqa": True}
            else:
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if mask is None:  # causal; one token after a cache (T < S) reads every key
            y = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] == k.shape[2], **gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
        return self._out(y, b, t)

    def _out(self, y: torch.Tensor, b: int, t: int) -> torch.Tensor:
        """(B, heads, T, D) attention output -> o_proj of this rank's (B, t) tokens (with parallel.cp: back from
        whole sequences for a share of the heads to this rank's slice for every head)."""
        y = y.transpose(1, 2)
        if self.context_parallel is not None:
            y = self.context_parallel.to_sequence(y)
        return self.o_proj(y.reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One pre-norm transformer block: the unit that FSDP shards and AC wraps. Its feed-forward `mlp` is the
    dense SwiGLU, or for a sparse layer of a mixture of experts (`cfg.is_moe_layer(i)`) `models.moe.MoE`."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.is_moe_layer(index):
            self.mlp = MoE(cfg.dim, cfg.n_experts, cfg.n_experts_per_tok, cfg.moe_ffn_dim, cfg.norm_topk_prob,
                           cfg.shared_expert_ffn_dim, layer=index)
        else:
            self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any = None,
                kv: LayerKV | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


def _loss_sum(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(h).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(h: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                          head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fp32 cross-entropy of `head`'s logits over final-norm outputs h (B, T, dim), summed over the targets.

    chunk_tokens > 0: the (B*T) tokens go through the head and the loss `chunk_tokens` at a time, each
    chunk under non-reentrant checkpointing, so its logits are freed once its loss is known and
    recomputed in backward (one more head forward per step); the head's gradient sums over the chunks.
    Peak logits memory: (chunk_tokens, vocab) instead of (B*T, vocab), in fp32 and the compute dtype.
    """
    h, labels = h.flatten(0, 1), labels.flatten()
    if labels.shape[0] != h.shape[0]:
        raise ValueError(f"labels hold {labels.shape[0]} tokens, the inputs {h.shape[0]}")
    n = h.shape[0]
    if chunk_tokens <= 0 or chunk_tokens >= n:
        return _loss_sum(head, h, labels)
    losses = [checkpoint(_loss_sum, head, h[i : i + chunk_tokens], labels[i : i + chunk_tokens], use_reentrant=False)
              for i in range(0, n, chunk_tokens)]
    return torch.stack(losses).sum()


class OutputHead(nn.Linear):
    """The output projection to the vocabulary (`lm_head`), which also computes the training loss.

    `forward(h)` gives logits; `forward(h, labels, chunk_tokens)` the chunked cross-entropy, every chunk through
    this weight, inside this one call: a sharding wrapper (FSDP) sees one forward and one backward of the head
    however many chunks there are, so the head can be a unit of its own, gathered once and freed after its
    backward (`shardlm.parallel.fsdp.apply_fsdp`)."""

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, chunk_tokens: int = 0) -> torch.Tensor:
        if labels is None:
            return F.linear(h, self.weight, self.bias)
        return chunked_cross_entropy(h, labels, chunk_tokens, lambda x: F.linear(x, self.weight, self.bias))


# An init spec: ("normal", std) | ("ones",) | ("zeros",)
InitSpec = tuple
# Maps a parameter to (its local tensor, the global index of its first row, or its offset in every dim when
# sharded along another dim). The identity for plain tensors; `shardlm.parallel` passes one that understands
# sharded DTensors.
ShardView = Callable[[torch.Tensor], tuple[torch.Tensor, Any]]


def _whole(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    return p, 0


class Transformer(nn.Module):
    # How `forward(tokens, positions)` masks documents: "auto" (`document_attention_backend` of the
    # tokens' device), "flex" or "sdpa-mask". Set it on the model (or the class) to force one.
    document_attention: str = "auto"
    context_parallel: Any = None  # parallel.cp: see `Attention.context_parallel` and `forward`

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # Tied: the output projection reads embed_tokens.weight (no second parameter to re-tie
        # after to_empty or sharding).
        self.lm_head = None if cfg.tie_embeddings else OutputHead(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, *,
                cache: KVCache | None = None, last_only: bool = False, labels: torch.Tensor | None = None,
                loss_chunk_tokens: int = 0) -> torch.Tensor:
        """tokens: (B, T) int64 -> logits (B, T, vocab) (with `last_only`: (B, 1, vocab), the last token's).

        positions: None (one sequence per row, positions 0..T-1, causal attention), or (B, T) int64,
        each token's position within its document (0 where a document starts; a row may start inside
        one): RoPE uses them and each token attends only to earlier tokens of its own document.

        cache: decode with a `KVCache`: the tokens continue what the cache holds (positions come from it,
        so `positions` must be None), their keys and values are appended, and each reads every earlier
        token of its row. `last_only` spares a prefill the (B, T, vocab) logits.

        labels: (B, T) int64 targets (IGNORE_INDEX: not a target): returns the fp32 cross-entropy summed over
        the targets (a scalar) instead of logits, computed `loss_chunk_tokens` tokens at a time (0: at once);
        see `loss`.

        With `context_parallel` set (parallel.cp), `tokens` and `labels` are this rank's contiguous slice of
        each row, (B, T / cp), as the loader reads them (`shardlm.data.order.context_slice`); `positions`,
        when given, cover the whole row (B, T): RoPE and the attention mask span the whole sequence.
        """
        if labels is not None and (cache is not None or last_only):
            raise ValueError("labels (a training loss) go with neither a KV cache nor last_only")
        cp = self.context_parallel
        if cp is not None:
            if cache is not None or last_only:
                raise ValueError("a context-parallel model trains and evaluates whole rows: no KV cache, no "
                                 "last_only (generate without parallel.cp)")
            if labels is not None and labels.shape != tokens.shape:
                raise ValueError(f"labels {tuple(labels.shape)} must be the shape of this rank's tokens "
                                 f"{tuple(tokens.shape)}")
            row = tokens.shape[1] * cp.size  # the whole row this slice belongs to
            if positions is not None and tuple(positions.shape) != (tokens.shape[0], row):
                raise ValueError(f"with context parallelism tokens are this rank's slice {tuple(tokens.shape)} of "
                                 f"rows of {row}, and positions cover whole rows: got {tuple(positions.shape)}")
            cp.check_length(row)
        else:
            row = tokens.shape[1]
        if cache is not None:
            if positions is not None:
                raise ValueError("positions come from the KV cache (its length and padding); pass one or the other")
            if tokens.shape[0] != cache.batch_size:
                raise ValueError(f"tokens have {tokens.shape[0]} rows but the KV cache {cache.batch_size}")
            t = tokens.shape[1]
            if cache.length + t > cache.max_len:
                raise ValueError(f"the KV cache holds {cache.length} of {cache.max_len} tokens: no room for {t} more; "
                                 "start a new cache with a larger max_len")
            cos, sin = self.rope.at(cache.positions(t, tokens.device))
            mask = cache.attention_mask(t, tokens.device)
        elif positions is None:
            cos, sin = self.rope(row)
            mask = None
        else:
            if cp is None and positions.shape != tokens.shape:
                raise ValueError(f"positions {tuple(positions.shape)} must have the shape of tokens "
                                 f"{tuple(tokens.shape)}")
            cos, sin = self.rope.at(positions)
            backend = self.document_attention
            if backend == "auto":
                backend = document_attention_backend(tokens.device)[0]
            mask = document_mask(positions, backend)
        h = self.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            if cache is not None:
                h = layer(h, cos, sin, mask, cache.layers[i])
            else:
                h = layer(h, cos, sin) if mask is None else layer(h, cos, sin, mask)
        if cache is not None:
            cache.advance(tokens.shape[1])
        if last_only:
            h = h[:, -1:]
        h = self.norm(h)
        if labels is not None:
            return self.loss(h, labels, loss_chunk_tokens)
        return self.head(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of final-norm outputs: `lm_head`, or the tied embeddings."""
        if self.lm_head is None:
            return F.linear(h, self.embed_tokens.weight.to(h.dtype))
        return self.lm_head(h)

    def loss(self, h: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 0) -> torch.Tensor:
        """fp32 cross-entropy of the head over final-norm outputs h (B, T, dim), summed over the targets
        (`chunked_cross_entropy`). An `OutputHead` runs it inside its one call; a tied or adapted head here."""
        if isinstance(self.lm_head, OutputHead):
            return self.lm_head(h, labels, chunk_tokens)
        return chunked_cross_entropy(h, labels, chunk_tokens, self.head)

    def new_cache(self, batch_size: int, max_len: int, pad: torch.Tensor | None = None) -> KVCache:
        """An empty `KVCache` for this model (see KVCache for `pad`)."""
        return KVCache(batch_size, max_len, len(self.layers), pad)

    # -- initialisation ------------------------------------------------------------------------
    def init_spec(self, name: str) -> InitSpec:
        """How parameter `name` is initialised: GPT-2/Llama style, depth-scaled residual outputs."""
        if name.endswith("norm.weight"):
            return ("ones",)
        if name.endswith(".bias"):
            return ("zeros",)
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            return ("normal", 0.02 / math.sqrt(2 * self.cfg.n_layers))
        return ("normal", 0.02)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, shard_view: ShardView = _whole,
                     only: Callable[[str], bool] | None = None) -> None:
        """Fill every parameter (or those whose name passes `only`) and recompute the RoPE buffers.

        The values depend only on `seed` and the parameter's name, never on how it is sharded:
        rows are drawn in fixed blocks, each from its own generator, so a rank that holds rows
        [a, b) draws just the blocks that cover them and gets the same numbers as one rank would.
        `only` skips what is about to be overwritten (the base weights of an HF load).
        """
        self.rope.reset_parameters()
        for mod_name, module in self.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                name = f"{mod_name}.{pname}" if mod_name else pname
                if only is not None and not only(name):
                    continue
                # A swapped-in module (LoRA) may say how its own parameters start.
                spec = module.init_spec(pname) if hasattr(module, "init_spec") and module is not self else None
                local, row0 = shard_view(p)
                fill_param(local, row0, model_shape(module, pname, p), spec or self.init_spec(name), seed, name)


def model_shape(module: nn.Module, pname: str, p: torch.Tensor) -> tuple[int, ...]:
    """The shape the model gives parameter `pname` of `module`: its own, or the one the module records in
    `logical_shapes` for a parameter held in another (stacked experts held flat in NF4: `shardlm.quant.nf4`)."""
    return tuple(getattr(module, "logical_shapes", {}).get(pname, p.shape))


def fill_param(
    local: torch.Tensor, row0: int | tuple[int, ...], full_shape: torch.Size, spec: InitSpec, seed: int, name: str
) -> None:
    """Fill `local` (rows row0.. of a tensor of `full_shape`) according to `spec`, shard-invariantly.

    `row0` may be the shard's offset in every dim (a shard along another dim than 0: stacked experts over more
    ranks than experts): its rows are drawn whole and cut."""
    offsets = (row0,) + (0,) * (len(full_shape) - 1) if isinstance(row0, int) else tuple(row0)
    row0 = offsets[0]
    cut = tuple(slice(o, o + n) for o, n in zip(offsets[1:], local.shape[1:]))
    kind = spec[0]
    if kind == "ones":
        local.fill_(1.0)
        return
    if kind == "zeros" or local.numel() == 0:
        local.zero_()
        return
    std = spec[1]
    row_numel = math.prod(full_shape[1:]) if len(full_shape) > 1 else 1
    block = max(1, (1 << 20) // row_numel)  # rows per generator draw: a function of the shape only
    n_rows = local.shape[0]
    base = (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)
    gen = torch.Generator(device=local.device)
    first, last = row0 // block, (row0 + n_rows - 1) // block
    for b in range(first, last + 1):
        lo, hi = b * block, min((b + 1) * block, full_shape[0])
        gen.manual_seed(base + b)
        vals = torch.randn((hi - lo, *full_shape[1:]), generator=gen, device=local.device, dtype=torch.float32)
        a, z = max(lo, row0), min(hi, row0 + n_rows)
        local[a - row0 : z - row0].copy_(vals[(slice(a - lo, z - lo), *cut)].mul_(std))
