"""Chunked cross-entropy under FSDP2 on 2 gloo ranks: the head and the loss run chunk by chunk inside the
root module's forward, each chunk recomputed in backward. The root's pre-backward hook must have the head's
weight unsharded again by then (the root reshards after forward): each chunk sees the full weight in forward
and in recompute, and loss and gradients equal the unchunked FSDP step and one unsharded process (fp32)."""

from __future__ import annotations

import pytest
import torch
from helpers.launch import run_ranks

B, T, CHUNK = 2, 13, 7  # 26 tokens per rank: chunks of 7, 7, 7, 5
CASES = ("plain", "tied", "lora", "tied_bf16")


def _build(kind: str, mesh=None):
    from shardlm.lora import DEFAULT_TARGETS, apply_lora
    from shardlm.models.llama import ModelConfig, Transformer
    from shardlm.parallel.fsdp import apply_fsdp, mp_policy, shard_view

    tie = kind.startswith("tied")
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=64, max_seq_len=32,
                      tie_embeddings=tie)
    with torch.device("meta"):
        m = Transformer(cfg)
    if kind == "lora":
        apply_lora(m, rank=4, alpha=8.0, targets=DEFAULT_TARGETS + ["lm_head"], train_norms=True)
    if mesh is not None:
        apply_fsdp(m, mesh, mp_policy("bf16" if kind.endswith("bf16") else "fp32", "fp32"))
    m.to_empty(device="cpu")
    m.init_weights(seed=0, shard_view=shard_view if mesh is not None else (lambda p: (p, 0)))
    with torch.no_grad():  # lora_B starts at zero: non-zero, so lora_A gets a gradient
        for n, p in m.named_parameters():
            if "lora_B" in n:
                local, row0 = shard_view(p)
                g = torch.Generator().manual_seed(len(n))
                local.copy_(torch.randn(p.shape, generator=g)[row0 : row0 + local.shape[0]] * 0.02)
    return m


def _batches(world: int):
    from shardlm.models.llama import IGNORE_INDEX

    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 97, (world * B, T), generator=g)
    y = torch.randint(0, 97, (world * B, T), generator=g)
    y[0, :8] = IGNORE_INDEX  # rank 0's first chunk has no target
    return x, y


def _grads(m) -> dict:
    from helpers.whole import whole

    return {n: whole(p.grad).clone()
            for n, p in m.named_parameters() if p.grad is not None}


def _worker() -> dict:
    import torch.distributed as dist

    from shardlm.distributed.env import init_distributed
    from shardlm.parallel.dims import ParallelDims
    from shardlm.train.step import forward_backward

    env = init_distributed("cpu")
    mesh = ParallelDims(1, -1, env.world_size).build_mesh("cpu")
    x, y = _batches(env.world_size)
    mine = (x[env.rank * B : (env.rank + 1) * B], y[env.rank * B : (env.rank + 1) * B])
    n_tokens = int((y != -100).sum())
    cpu = torch.device("cpu")
    out = {}
    from shardlm.models import llama

    loss_sum = llama._loss_sum
    for kind in CASES:
        m = _build(kind, mesh)
        seen = []  # the head weight each chunk computes with: (plain tensor?, shape), forward and recompute

        def spy(head, h, labels, m=m):
            w = m.embed_tokens.weight if m.lm_head is None else m.lm_head.weight
            seen.append((type(w).__name__, tuple(w.shape)))
            return loss_sum(head, h, labels)

        res = {}
        for chunk in (0, CHUNK):
            m.zero_grad(set_to_none=True)
            llama._loss_sum = spy if chunk else loss_sum
            try:
                loss = forward_backward(m, [mine], env.world_size / n_tokens, cpu, loss_chunk_tokens=chunk)
            finally:
                llama._loss_sum = loss_sum
            dist.all_reduce(loss)
            res[chunk] = (loss.item(), _grads(m))
        out[kind] = {"res": res, "seen": seen}
    if env.rank == 0:  # one unsharded process over the global batch
        for kind in CASES:
            if kind.endswith("bf16"):
                continue
            m = _build(kind)
            loss = forward_backward(m, [(x, y)], 1.0 / n_tokens, cpu, loss_chunk_tokens=0)
            out[kind]["single"] = (loss.item(), _grads(m))
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(2, _worker)


def _assert_near(got: dict, want: dict, rel: float, what: str) -> None:
    assert got.keys() == want.keys(), what
    for n, g in want.items():
        err, scale = (got[n] - g).abs().max().item(), g.abs().max().item()
        assert err <= rel * scale, f"{what}: grad of {n}: max error {err:.3g} of {scale:.3g}"


@pytest.mark.parametrize("kind", CASES)
def test_chunked_equals_unchunked_under_fsdp(results, kind):
    r = results[kind]
    # 4 chunks, each seen in forward and again in the backward recompute, with the full (unsharded) weight
    assert r["seen"] == [("Parameter", (97, 32))] * 8, r["seen"]
    (loss0, g0), (loss, g) = r["res"][0], r["res"][CHUNK]
    rel = 1e-2 if kind.endswith("bf16") else 1e-6  # bf16: the chunk's matmul may block its rows differently
    assert loss == pytest.approx(loss0, rel=rel)
    _assert_near(g, g0, rel, f"{kind}: chunked vs unchunked FSDP")
    if "single" in r:
        loss1, g1 = r["single"]
        assert loss == pytest.approx(loss1, rel=1e-6)
        _assert_near(g, g1, 1e-6, f"{kind}: FSDP chunked vs one process")
