"""Chunked cross-entropy (train.loss_chunk_tokens): the output head and the loss run a chunk of tokens at a
time inside `Transformer.forward(..., labels=)`. Loss and every gradient equal the unchunked path (fp32,
1e-6): plain, tied embeddings, LoRA (on the head too), document masks, chunk sizes that do not divide the
token count, ignored labels; and the step's peak memory drops by about the size of the logits."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from shardlm.config import load_config
from shardlm.errors import ConfigError
from shardlm.lora import DEFAULT_TARGETS, apply_lora
from shardlm.models.llama import IGNORE_INDEX, ModelConfig, Transformer
from shardlm.train.step import forward_backward

TOL = {"rtol": 1e-6, "atol": 0.0}
REL = 1e-6  # of a gradient's largest entry: chunks only change the order of the fp32 sums


def assert_near(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= REL * scale, f"{what}: max error {err:.3g}, {err / max(scale, 1e-30):.3g} of the largest entry"
B, T = 2, 13  # 26 tokens: no chunk size below divides it but 2 and 13


def _model(tie: bool = False, lora: bool = False, vocab: int = 97, seed: int = 0) -> Transformer:
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab, ffn_dim=64, max_seq_len=64,
                      tie_embeddings=tie)
    with torch.device("meta"):
        m = Transformer(cfg)
    if lora:
        targets = DEFAULT_TARGETS + ([] if tie else ["lm_head"])
        apply_lora(m, rank=4, alpha=8.0, targets=targets, train_norms=True)
    m.to_empty(device="cpu")
    m.init_weights(seed=seed)
    if lora:  # lora_B starts at zero: make it non-zero, so lora_A has a gradient to compare
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    return m


def _batch(vocab: int = 97, positions: bool = False):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (B, T), generator=g)
    y = torch.randint(0, vocab, (B, T), generator=g)
    y[0, :6] = IGNORE_INDEX  # a whole chunk of 3 or 5 tokens with no target
    y[1, 9] = IGNORE_INDEX
    pos = None
    if positions:
        pos = torch.cat([torch.arange(5), torch.arange(8)]).expand(B, T).clone()
    return x, y, pos


def _reference(m: Transformer, x, y, pos) -> tuple[torch.Tensor, dict]:
    """The unchunked path as the step ran it before: full logits, then F.cross_entropy."""
    m.zero_grad(set_to_none=True)
    logits = m(x, pos)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _chunked(m: Transformer, x, y, pos, chunk: int) -> tuple[torch.Tensor, dict]:
    m.zero_grad(set_to_none=True)
    loss = m(x, pos, labels=y, loss_chunk_tokens=chunk)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["plain", "tied", "lora", "lora_tied", "doc_mask"])
def test_loss_and_gradients_equal_unchunked(kind):
    m = _model(tie="tied" in kind, lora="lora" in kind)
    x, y, pos = _batch(positions=kind == "doc_mask")
    want_loss, want = _reference(m, x, y, pos)
    assert len(want) > 4
    if "lora" in kind:
        assert all("lora" in n or "norm" in n for n in want)
        assert any("lm_head.lora_A" in n for n in want) == (kind == "lora")
    for chunk in (0, 1, 3, 5, 7, 25, 26, 4096):
        loss, got = _chunked(m, x, y, pos, chunk)
        torch.testing.assert_close(loss, want_loss, **TOL, msg=f"chunk {chunk}: loss")
        assert got.keys() == want.keys()
        for n in want:
            assert_near(got[n], want[n], f"chunk {chunk}: grad of {n}")


def test_step_uses_chunks():
    """forward_backward with loss_chunk_tokens: the same loss sum and gradients as without."""
    m = _model()
    x, y, _ = _batch()
    want = forward_backward(m, [(x, y), (y.clamp_min(0), x)], 0.5, torch.device("cpu"))
    want_g = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    got = forward_backward(m, [(x, y), (y.clamp_min(0), x)], 0.5, torch.device("cpu"), loss_chunk_tokens=4)
    torch.testing.assert_close(got, want, **TOL)
    for n, p in m.named_parameters():
        assert_near(p.grad, want_g[n], n)


def test_checks_and_config():
    from shardlm.data.loader import IGNORE_INDEX as DATA_IGNORE

    assert IGNORE_INDEX == DATA_IGNORE
    m = _model()
    x, y, _ = _batch()
    with pytest.raises(ValueError, match="KV cache"):
        m(x, labels=y, cache=m.new_cache(B, 32))
    with pytest.raises(ValueError, match="labels hold"):
        m(x, labels=y[:, :-1])
    assert m(x).shape == (B, T, 97)  # the old call still returns logits
    assert load_config(None, []).train.loss_chunk_tokens == 4096
    assert load_config(None, ["--train.loss_chunk_tokens=0"]).train.loss_chunk_tokens == 0
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens must be >= 0"):
        load_config(None, ["--train.loss_chunk_tokens=-1"])


def _peak_rss_step(m: Transformer, x, y, chunk: int) -> int:
    """Bytes the RSS high-water mark rose by during one forward_backward (Linux: reset through clear_refs)."""
    m.zero_grad(set_to_none=False)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            line = next(s for s in f if s.startswith(key + ":"))
        return int(line.split()[1]) * 1024

    base = status("VmRSS")
    forward_backward(m, [(x, y)], 1.0, torch.device("cpu"), loss_chunk_tokens=chunk)
    return status("VmHWM") - base


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="measures the RSS high-water mark through Linux's /proc/self/clear_refs")
def test_peak_memory_drops_by_the_logits():
    """vocab 128k, 512 tokens: the unchunked step holds (tokens, vocab) fp32 logits (and their softmax and
    gradient); 128-token chunks hold a quarter of that at a time. Measured, not modelled: the process's
    resident-set high-water mark over one step (torch's CPU allocations are plain malloc/mmap)."""
    vocab, seq = 128_256, 512
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, vocab_size=vocab, ffn_dim=128, max_seq_len=seq)
    with torch.device("meta"):
        m = Transformer(cfg)
    m.to_empty(device="cpu")
    m.init_weights(seed=0)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, vocab, (1, seq), generator=g) for _ in range(2))
    logits = seq * vocab * 4
    for p in m.parameters():
        p.grad = torch.zeros_like(p)  # as after a first step: only the step's transients are measured
    plain = _peak_rss_step(m, x, y, 0)
    chunked = _peak_rss_step(m, x, y, 128)
    print(f"peak over one step: unchunked {plain / 2**20:.0f} MiB, chunks of 128 {chunked / 2**20:.0f} MiB "
          f"(fp32 logits {logits / 2**20:.0f} MiB)")
    assert plain > 2 * logits  # the measurement sees the logits at all
    assert plain - chunked > logits
