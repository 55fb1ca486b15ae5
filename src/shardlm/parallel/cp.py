"""Context parallelism (parallel.cp): one sequence's tokens split over `cp` ranks, attention by all-to-all over
heads (DeepSpeed-Ulysses).

Every rank of a CP group is dealt the same rows and reads only its contiguous `T / cp` tokens of each (and
their labels: `shardlm.data.order.context_slice`; a token store's windows are read slice by slice, positions
for document masks come from the document offsets alone), so the embeddings, MLPs, norms, the output head
and the loss run on a slice and their activations shrink by `cp`. Attention needs the whole sequence: before it, one all-to-all turns
(B, T / cp, H, D) queries, keys and values into (B, T, H / cp, D) -- every token of the sequence for a
share of the heads -- so any kernel (flash/cuDNN SDPA, flex with a document mask, the CPU one) runs
unchanged on whole sequences with their global RoPE positions and masks; a second all-to-all brings the
output back to the slice. Labels were shifted before the slice, so the last token of rank i predicts the first
of rank i + 1 without any exchange, and every target token is counted once over the group.

Why Ulysses and not ring attention: it keeps document masks, packing and every SDPA kernel (torch's ring
`context_parallel` takes CUDA flash/efficient/cuDNN SDPA only, causal or no mask: it refuses the CPU op and
any attention mask), it needs no load balancing (each rank attends over the whole sequence), and its traffic
per layer is 4 all-to-alls of the local activations, independent of `cp`. Its limit is the heads: `cp` must
divide the query heads; when it does not divide the KV heads (GQA), keys and values are repeated to the
query heads before the exchange (the startup line says so: more traffic, no change in the result).

FSDP shards the parameters over `dp_shard x cp` (`dims.fsdp_mesh`), as torchtitan does: CP ranks hold
different tokens of the same rows, so their gradients add up like those of data-parallel ranks, and CP
costs no parameter memory.
"""

from __future__ import annotations

import torch
from torch import nn

from shardlm.errors import ConfigError
from shardlm.models.llama import Attention


class Ulysses:
    """The attention exchange of one CP group (`group`, this rank at `rank` of `size`), for a model with
    `n_heads` query and `n_kv_heads` key/value heads. Set on the model by `apply_context_parallel`."""

    def __init__(self, group, rank: int, size: int, n_heads: int, n_kv_heads: int):
        self.group, self.rank, self.size = group, rank, size
        self.kv_repeat = 1 if n_kv_heads % size == 0 else n_heads // n_kv_heads

    def check_length(self, t: int) -> None:
        check_length(self.size, t)

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """all-to-all of dim 0's `size` chunks (chunk j to rank j; chunk j back from rank j), with autograd."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        return all_to_all_single_autograd(x.contiguous(), None, None, self.group)

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T / cp, H, D) -> (B, T, H / cp, D): the whole sequence, this rank's share of the heads."""
        b, t, h, d = x.shape
        chunks = x.view(b, t, self.size, h // self.size, d).permute(2, 0, 1, 3, 4)  # (cp, B, t, H/cp, D)
        out = self._exchange(chunks).view(self.size, b, t, h // self.size, d)  # from rank j: its slice j
        return out.permute(1, 0, 2, 3, 4).reshape(b, self.size * t, h // self.size, d)

    def to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """(B, T, H / cp, D) -> (B, T / cp, H, D): back to this rank's slice, every head."""
        b, big_t, h, d = y.shape
        t = big_t // self.size
        chunks = y.view(b, self.size, t, h, d).permute(1, 0, 2, 3, 4)  # (cp, B, t, H/cp, D): slice j to rank j
        out = self._exchange(chunks).view(self.size, b, t, h, d)  # from rank j: heads of rank j
        return out.permute(1, 2, 0, 3, 4).reshape(b, t, self.size * h, d)

    def qkv_to_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """(B, T / cp, heads, D) each -> whole sequences for this rank's heads; KV heads repeated first when
        `cp` does not divide them."""
        if self.kv_repeat > 1:
            k, v = k.repeat_interleave(self.kv_repeat, dim=2), v.repeat_interleave(self.kv_repeat, dim=2)
        return self.to_heads(q), self.to_heads(k), self.to_heads(v)

    def describe(self, n_heads: int, n_kv_heads: int) -> str:
        kv = n_kv_heads * self.kv_repeat // self.size
        note = (f" (the {n_kv_heads} KV heads repeated to {n_heads}: cp={self.size} does not divide them)"
                if self.kv_repeat > 1 else "")
        return (f"context parallel cp={self.size}: Ulysses all-to-all over heads, each rank attends over whole "
                f"sequences with {n_heads // self.size} of {n_heads} query and {kv} KV heads{note}")


def check_length(cp: int, t: int) -> None:
    """One ConfigError line for rows of `t` tokens that `cp` ranks cannot split evenly."""
    if t % cp:
        raise ConfigError(f"parallel.cp={cp} splits each sequence into {cp} equal slices, but data.seq_len="
                          f"{t}; make data.seq_len a multiple of {cp}")


def check_cp(cp: int, n_heads: int, seq_len: int) -> None:
    """One ConfigError line for a CP degree the model's heads or the sequence length cannot take."""
    if cp <= 1:
        return
    if n_heads % cp:
        raise ConfigError(f"parallel.cp={cp} must divide the model's {n_heads} attention heads (Ulysses gives each "
                          f"CP rank a whole number of heads); pick a divisor of {n_heads}")
    check_length(cp, seq_len)


def apply_context_parallel(model: nn.Module, group, rank: int, size: int) -> Ulysses:
    """Give `model` (a `Transformer`) and each of its attention layers the CP group's exchange."""
    cfg = model.cfg
    cp = Ulysses(group, rank, size, cfg.n_heads, cfg.n_kv_heads)
    model.context_parallel = cp
    for m in model.modules():  # inside AC / compile wrappers alike
        if isinstance(m, Attention):
            m.context_parallel = cp
    return cp


__all__ = ["Ulysses", "apply_context_parallel", "check_cp"]
