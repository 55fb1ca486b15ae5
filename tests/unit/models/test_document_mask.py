"""Document masking for packed rows: a packed row computes exactly what its documents compute alone.

Model (`Transformer.forward(tokens, positions)`, both attention backends, GQA, qk-norm), labels
(`shardlm.data.packing`), the step (`forward_backward` with (x, y, positions)), SFT packed rows, and
the positions=None path unchanged bit for bit.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shardlm.data.loader import PackedLoader
from shardlm.data.order import IGNORE_INDEX
from shardlm.data.packing import (
    doc_starts_from_eos,
    document_rows,
    mask_cross_document,
    window_positions,
)
from shardlm.data.sft import SFTLoader, build_sft_loader
from shardlm.data.tokenizer import ByteTokenizer
from shardlm.models import llama
from shardlm.models.llama import (
    ModelConfig,
    Transformer,
    document_attention_backend,
    document_causal_mask,
    document_mask_mod,
    document_segments,
)
from shardlm.parallel.ac import apply_ac
from shardlm.train.step import forward_backward


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    """build_sft_loader prepares a store in the data cache: a fresh one per test, never ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))

VOCAB = 64
CONFIGS = {
    "gqa": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=VOCAB, max_seq_len=48),
    "mha": ModelConfig(dim=64, n_layers=2, n_heads=4, ffn_dim=96, vocab_size=VOCAB, max_seq_len=48),
    "qk_norm_mqa": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=96, vocab_size=VOCAB,
                               max_seq_len=48, qk_norm=True, qkv_bias=True, rope_theta=1e6),
}


def _model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A tiny fp32 model with weights large enough that attention patterns matter."""
    torch.manual_seed(seed)
    m = Transformer(cfg)
    m.init_weights(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return m.eval()


@pytest.fixture
def eager_flex(monkeypatch):
    """The flex path with uncompiled flex attention (exact, dense under the hood: fine for tiny tests)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    monkeypatch.setattr(llama, "_FLEX", (flex_attention, create_block_mask))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        yield


def _row(docs: list[torch.Tensor], first_pos: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents concatenated into one row, with positions; the first continues from `first_pos`."""
    tokens = torch.cat(docs)
    positions = torch.cat([torch.arange(len(d)) + (first_pos if i == 0 else 0) for i, d in enumerate(docs)])
    return tokens, positions


def _docs(lengths: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


# -- the model ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["sdpa-mask", "flex"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_row_equals_each_document_alone(name, backend, request):
    if backend == "flex":
        request.getfixturevalue("eager_flex")
    m = _model(CONFIGS[name])
    m.document_attention = backend
    row0 = _docs([5, 1, 9, 2, 15], seed=1)  # starts at a document start; a one-token document
    tail = _docs([7], seed=2)[0]  # row 1 starts 4 tokens into a document
    row1 = [tail, *_docs([20, 1, 4], seed=3)]
    (t0, p0), (t1, p1) = _row(row0), _row(row1, first_pos=4)
    assert len(t0) == len(t1) == 32
    with torch.no_grad():
        got = m(torch.stack([t0, t1]), torch.stack([p0, p1]))
        assert got.abs().max() > 0.5  # not a degenerate model
        for b, docs in ((0, row0), (1, row1)):
            at = 0
            for i, d in enumerate(docs):
                if b == 1 and i == 0:  # the leading partial document: its true positions, and RoPE is relative
                    want = m(d[None], torch.arange(4, 4 + len(d))[None])[0]
                    torch.testing.assert_close(m(d[None])[0], want, rtol=1e-5, atol=1e-5)
                else:
                    want = m(d[None])[0]
                torch.testing.assert_close(got[b, at : at + len(d)], want, rtol=1e-5, atol=1e-5)
                at += len(d)


def test_one_document_per_row_equals_plain_causal():
    m = _model(CONFIGS["gqa"])
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(m(x, torch.arange(40).expand(2, 40)), m(x), rtol=1e-5, atol=1e-5)


def _reference_causal(m: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """The model's forward before document masking existed, written out: positions 0..T-1, is_causal SDPA."""
    t = tokens.shape[1]
    cos, sin = m.rope.cos[:t], m.rope.sin[:t]

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def rope(x):  # ops in the model's order (the order autograd sums the two uses of x in)
        return x * cos + rotate_half(x) * sin

    h = m.embed_tokens(tokens)
    for blk in m.layers:
        a, x = blk.self_attn, blk.input_layernorm(h)
        b = x.shape[0]
        q = a.q_proj(x).view(b, t, a.n_heads, a.head_dim)
        k = a.k_proj(x).view(b, t, a.n_kv_heads, a.head_dim)
        v = a.v_proj(x).view(b, t, a.n_kv_heads, a.head_dim)
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = rope(q), rope(k)
        if a.n_kv_heads != a.n_heads:
            rep = a.n_heads // a.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + a.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        h = h + blk.mlp(blk.post_attention_layernorm(h))
    return m.lm_head(m.norm(h))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_without_positions_the_forward_is_unchanged_bit_for_bit(name):
    m = _model(CONFIGS[name]).train()
    x = torch.randint(0, VOCAB, (3, 48), generator=torch.Generator().manual_seed(5))
    got, want = m(x), _reference_causal(m, x)
    assert torch.equal(got, want)
    g_got = torch.autograd.grad(got.square().sum(), list(m.parameters()))
    g_want = torch.autograd.grad(want.square().sum(), list(m.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(g_got, g_want))


def test_positions_may_pass_the_rope_table_and_must_match_the_tokens():
    m = _model(CONFIGS["gqa"])  # max_seq_len 48
    x = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        far = m(x, torch.arange(1000, 1016)[None])  # a row deep inside a long document
        torch.testing.assert_close(far, m(x), rtol=1e-4, atol=1e-4)  # RoPE is relative (fp32 angles at 1e3)
        with pytest.raises(ValueError, match="shape of tokens"):
            m(x, torch.arange(15)[None])
    c, s = m.rope.at(torch.arange(48).expand(2, 48))
    assert torch.equal(c[1], m.rope.cos) and torch.equal(s[0], m.rope.sin)  # the same numbers as the table


def test_activation_checkpointing_with_positions_gives_the_same_gradients():
    cfg = CONFIGS["gqa"]
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(7))
    pos = torch.stack([_row(_docs([10, 22], 0))[1], _row(_docs([3, 3, 26], 0), first_pos=2)[1]])
    grads = []
    for ac in ("none", "full"):
        m = _model(cfg).train()
        apply_ac(m, ac)
        m(x, pos).square().mean().backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# -- the attention backends --------------------------------------------------------------------------
def test_backend_choice(monkeypatch):
    assert document_attention_backend(torch.device("cpu"))[0] == "sdpa-mask"
    assert document_attention_backend("meta")[0] == "sdpa-mask"
    name, why = document_attention_backend("cpu")
    assert "CUDA" in why and "cpu" in why
    monkeypatch.setattr(llama, "_flex_importable", lambda: True)
    monkeypatch.setattr(llama.importlib.util, "find_spec", lambda name: object() if name == "triton" else None)
    assert document_attention_backend(torch.device("cuda", 1))[0] == "flex"
    monkeypatch.setattr(llama.importlib.util, "find_spec", lambda name: None)
    name, why = document_attention_backend("cuda")
    assert name == "sdpa-mask" and "triton" in why
    monkeypatch.setattr(llama, "_flex_importable", lambda: False)
    name, why = document_attention_backend("cuda")
    assert name == "sdpa-mask" and torch.__version__ in why


def test_auto_on_cpu_is_the_sdpa_mask_and_unknown_backends_are_refused():
    m = _model(CONFIGS["gqa"])
    x = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(8))
    pos = torch.stack([_row(_docs([10, 14], 0))[1], _row(_docs([24], 0))[1]])
    with torch.no_grad():
        auto = m(x, pos)
        m.document_attention = "sdpa-mask"
        assert torch.equal(auto, m(x, pos))
        m.document_attention = "xformers"
        with pytest.raises(ValueError, match="flex, sdpa-mask"):
            m(x, pos)


def test_flex_mask_mod_evaluated_densely_is_the_sdpa_mask():
    g = torch.Generator().manual_seed(9)
    B, T = 3, 40
    positions = torch.stack([_row(_docs(lengths, 0), first)[1] for lengths, first in
                             (([1] * 40, 0), ([13, 1, 1, 25], 5), ([40], 0))])
    positions[2] = torch.randint(0, 3, (T,), generator=g)  # arbitrary restarts
    seg = document_segments(positions)
    assert seg[1, 0] == 0 and seg[0, 0] == 1  # a row that starts mid-document begins in segment 0
    dense = document_causal_mask(seg)
    assert dense.shape == (B, 1, T, T) and dense.dtype == torch.bool
    b = torch.arange(B)[:, None, None, None]
    q, kv = torch.arange(T)[None, None, :, None], torch.arange(T)[None, None, None, :]
    assert torch.equal(document_mask_mod(seg)(b, torch.zeros(1, dtype=torch.long), q, kv), dense)
    # and a brute-force definition: same document and not in the future
    want = torch.tensor([[[[int(seg[i, t]) == int(seg[i, s]) and s <= t for s in range(T)] for t in range(T)]]
                         for i in range(B)])
    assert torch.equal(dense, want)


@pytest.mark.slow
def test_compiled_flex_path_on_cpu_matches_documents_alone():
    """The real path (torch.compile'd flex attention and block mask), where inductor can compile it for CPU."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    m = _model(CONFIGS["gqa"])
    docs = _docs([5, 1, 9, 2, 15], seed=1)
    t, p = _row(docs)
    with torch.no_grad():
        m.document_attention = "flex"
        try:
            got = m(t[None], p[None])[0]
        except Exception as e:  # no C++ toolchain, or this torch cannot compile flex attention for CPU
            pytest.skip(f"compiled flex attention does not run on this CPU: {type(e).__name__}: {e}"[:300])
        at = 0
        for d in docs:
            torch.testing.assert_close(got[at : at + len(d)], m(d[None])[0], rtol=1e-5, atol=1e-5)
            at += len(d)


# -- packing helpers ---------------------------------------------------------------------------------
def _naive_positions(lengths: list[int], lo: int, hi: int) -> list[int]:
    out = []
    for i in range(lo, hi):
        start = 0
        for n in lengths:
            if start + n > i:
                break
            start += n
        out.append(i - start)
    return out


def _stream(lengths: list[int], rng: np.random.Generator, eos: int = 0) -> np.ndarray:
    return np.concatenate([np.append(rng.integers(1, VOCAB, n - 1), eos) for n in lengths]).astype(np.uint16)


def test_window_positions_match_a_naive_loop():
    rng = np.random.default_rng(0)
    for trial in range(40):
        lengths = [int(n) for n in rng.choice([1, 1, 2, 3, 7, 30, 90], size=int(rng.integers(1, 12)))]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        total = sum(lengths)
        cases = [(0, total), (0, 0), (total, total), *[(s, min(total, s + 16)) for s in starts]]
        cases += [tuple(sorted(rng.integers(0, total + 1, 2))) for _ in range(10)]
        for lo, hi in cases:
            got = window_positions(starts, int(lo), int(hi))
            assert got.dtype == np.int64 and got.tolist() == _naive_positions(lengths, lo, hi), (lengths, lo, hi)
    assert window_positions(np.array([0]), 5, 9).tolist() == [5, 6, 7, 8]  # inside one long document
    assert window_positions(np.array([0, 3, 3, 4]), 2, 6).tolist() == [2, 0, 0, 1]  # an empty document is harmless
    with pytest.raises(ValueError, match="begin with 0"):
        window_positions(np.array([2, 5]), 0, 4)


def test_doc_starts_from_eos():
    tokens = np.array([5, 6, 0, 0, 7, 0, 8, 9, 0])
    assert doc_starts_from_eos(tokens, 0).tolist() == [0, 3, 4, 6]
    assert doc_starts_from_eos(np.array([4, 4]), 0).tolist() == [0]


def test_mask_cross_document_numpy_and_torch():
    labels, target_pos = np.array([3, 4, 5, 6]), np.array([1, 0, 1, 0])
    assert mask_cross_document(labels, target_pos).tolist() == [3, IGNORE_INDEX, 5, IGNORE_INDEX]
    t = mask_cross_document(torch.tensor(labels), torch.tensor(target_pos))
    assert t.dtype == torch.int64 and t.tolist() == [3, IGNORE_INDEX, 5, IGNORE_INDEX]
    assert labels.tolist() == [3, 4, 5, 6]  # a copy
    assert mask_cross_document(labels.astype(np.uint16), target_pos).tolist() == [3, -100, 5, -100]


def test_document_rows_are_packed_loader_windows_with_cross_document_targets_masked():
    rng = np.random.default_rng(1)
    lengths = [1, 4, 1, 1, 40, 3, 12, 2, 9, 1, 30, 5, 8, 1, 7]  # single-token documents and one longer than a row
    tokens = _stream(lengths, rng)
    starts = doc_starts_from_eos(tokens, 0)
    assert starts.tolist() == np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    L = 16
    loader = PackedLoader(tokens, L, micro_batch_size=1, grad_accum=1, dp_rank=0, dp_size=1, shuffle=False)
    windows = list(range(loader.n_rows))[::-1]
    x, y, pos = document_rows(tokens, starts, windows, L)
    px, py = loader.rows(windows)
    assert x.dtype == y.dtype == pos.dtype == torch.int64 and x.shape == y.shape == pos.shape == (len(windows), L)
    assert torch.equal(x, px)
    start_set = set(starts.tolist())
    for r, w in enumerate(windows):
        assert pos[r].tolist() == _naive_positions(lengths, w * L, w * L + L)
        for j in range(L):
            target = w * L + 1 + j  # the index of label j's token in the stream
            want = IGNORE_INDEX if target in start_set else int(py[r, j])
            assert int(y[r, j]) == want
    # some targets cross a boundary (masked); predicting a document's own EOS (id 0) stays a target
    assert (y == IGNORE_INDEX).sum() > 0 and ((y != IGNORE_INDEX) & (py == 0)).sum() > 0
    empty = document_rows(tokens, starts, [], L)
    assert all(t.shape == (0, L) for t in empty)
    with pytest.raises(ValueError, match="tokens; the stream has"):
        document_rows(tokens, starts, [loader.n_rows + 1], L)


def test_loss_ignores_cross_document_targets_and_equals_the_per_document_losses():
    m = _model(CONFIGS["gqa"])
    rng = np.random.default_rng(2)
    lengths = [6, 1, 11, 2, 5, 8]  # 33 tokens: one window of 32 inputs, the first at a document start
    tokens = _stream(lengths, rng)
    L = len(tokens) - 1
    x, y, pos = document_rows(tokens, doc_starts_from_eos(tokens, 0), [0], L)
    assert int((y != IGNORE_INDEX).sum()) == L - (len(lengths) - 1)
    want, n_want, at = torch.zeros(()), 0, 0
    with torch.no_grad():
        for n in lengths:
            doc = torch.from_numpy(tokens[at : at + n].astype(np.int64))
            if n > 1:
                logits = m(doc[None, :-1])[0]
                want += F.cross_entropy(logits, doc[1:], reduction="sum")
                n_want += n - 1
            at += n
    assert n_want == int((y != IGNORE_INDEX).sum())
    m.train()
    got = forward_backward(m, [(x, y, pos)], scale=1.0 / n_want, device=torch.device("cpu"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the (x, y) batch is the model without positions, as before
    m.zero_grad()
    plain = forward_backward(m, [(x, y)], scale=1.0, device=torch.device("cpu"))
    with torch.no_grad():
        ref = F.cross_entropy(m(x)[0], y[0], ignore_index=IGNORE_INDEX, reduction="sum")
    assert torch.equal(plain, ref) and not torch.allclose(plain, got)


# -- SFT packed rows ---------------------------------------------------------------------------------
def _sft_samples(n: int, rng: np.random.Generator) -> list[tuple[list[int], list[bool]]]:
    out = []
    for s in range(n):
        length = int(rng.integers(3, 14))
        ids = [1000 * (s + 1) + t for t in range(length)]
        mask = [t >= max(2, length // 2) for t in range(length)]
        out.append((ids, mask))
    return out


def test_sft_packed_rows_carry_positions_that_restart_at_each_sample():
    samples = _sft_samples(30, np.random.default_rng(3))
    L = 24
    plain = SFTLoader(samples, L, micro_batch_size=4, grad_accum=2, dp_rank=0, dp_size=1, pack=True, pad_id=7)
    masked = SFTLoader(samples, L, micro_batch_size=4, grad_accum=2, dp_rank=0, dp_size=1, pack=True, pad_id=7,
                       document_mask=True)
    for (x0, y0), (x1, y1, p1) in zip(plain.next_step(), masked.next_step()):
        assert torch.equal(x0, x1) and torch.equal(y0, y1) and p1.shape == x1.shape and p1.dtype == torch.int64
    for w in range(masked.n_rows):
        x, y = masked.row(w)
        pos = masked.row_positions(w)
        at = 0
        for i in masked.row_samples(w):
            n = int(masked.lengths[i])
            assert pos[at : at + n].tolist() == list(range(n))
            if at > 0:  # the previous sample's last label is its own EOS (or nothing), never this sample's start
                assert y[at - 1] == IGNORE_INDEX or y[at - 1] // 1000 == x[at - 1] // 1000 != x[at] // 1000
            at += n
        assert pos[at:].tolist() == list(range(L - at))  # the padding is one more "document"
        assert not set(y[y != IGNORE_INDEX].tolist()) & set(x[pos == 0].tolist())  # no label is a sample's start
    x, y, p = masked.rows([0, 1])
    assert p.shape == (2, L)


def test_sft_document_mask_model_rows_equal_samples_alone():
    samples = _sft_samples(12, np.random.default_rng(4))
    samples = [([i % VOCAB for i in ids], mask) for ids, mask in samples]
    loader = SFTLoader(samples, 32, micro_batch_size=2, grad_accum=1, dp_rank=0, dp_size=1, pack=True,
                       document_mask=True)
    m = _model(CONFIGS["qk_norm_mqa"])
    w = max(range(loader.n_rows), key=lambda r: len(loader.row_samples(r)))
    x, _, pos = loader.rows([w])
    assert len(loader.row_samples(w)) > 1
    with torch.no_grad():
        got = m(x, pos)[0]
        at = 0
        for i in loader.row_samples(w):
            ids = torch.tensor(samples[i][0][:-1])
            torch.testing.assert_close(got[at : at + len(ids)], m(ids[None])[0], rtol=1e-5, atol=1e-5)
            at += len(ids)


def test_build_sft_loader_document_mask_option(tmp_path):
    import json

    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"q{i}", "completion": "a" * i}) for i in range(1, 12)))
    kw = dict(seq_len=48, micro_batch_size=2, grad_accum=1)
    plain, _ = build_sft_loader([f], ByteTokenizer(), None, **kw)
    masked, _ = build_sft_loader([f], ByteTokenizer(), None, document_mask=True, **kw)
    a, b = plain.next_step()[0], masked.next_step()[0]
    assert len(a) == 2 and len(b) == 3 and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
