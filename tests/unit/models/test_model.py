from __future__ import annotations

import pytest
import torch

from shardlm.generate import generate
from shardlm.models import PRESETS, ModelConfig, Transformer
from shardlm.models.llama import fill_param

TINY = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50, max_seq_len=16)


def test_param_count_matches_published_sizes():
    assert PRESETS["llama3_8b"].num_params() == 8_030_261_248
    assert PRESETS["llama3_70b"].num_params() == 70_553_706_496
    assert PRESETS["qwen3_0_6b"].num_params() == 596_049_920
    m = Transformer(PRESETS["debug"])
    assert sum(p.numel() for p in m.parameters()) == PRESETS["debug"].num_params()


def test_debug_preset_is_small_enough_for_tests():
    assert PRESETS["debug"].num_params() < 1_000_000


@pytest.mark.parametrize("rows", [1, 3, 7])
def test_init_is_the_same_whatever_the_row_split(rows):
    shape = torch.Size([10, 6])
    full = torch.empty(shape)
    fill_param(full, 0, shape, ("normal", 0.02), seed=1, name="w")
    parts = []
    for r0 in range(0, 10, rows):
        part = torch.empty(min(rows, 10 - r0), 6)
        fill_param(part, r0, shape, ("normal", 0.02), seed=1, name="w")
        parts.append(part)
    assert torch.equal(torch.cat(parts), full)
    other = torch.empty(shape)
    fill_param(other, 0, shape, ("normal", 0.02), seed=2, name="w")
    assert not torch.equal(other, full)
    assert full.std().item() == pytest.approx(0.02, rel=0.5)


def test_init_specs_and_meta_build():
    with torch.device("meta"):
        m = Transformer(TINY)
    m.to_empty(device="cpu")
    m.init_weights(seed=0)
    assert torch.equal(m.norm.weight, torch.ones(32))
    assert m.layers[0].mlp.down_proj.weight.std() < m.layers[0].mlp.up_proj.weight.std()
    assert torch.isfinite(m.rope.cos).all() and m.rope.cos[0].eq(1).all()


def test_causal_and_tied():
    torch.manual_seed(0)
    m = Transformer(TINY)
    m.init_weights(0)
    x = torch.randint(0, 50, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 50
    assert torch.allclose(m(x)[0, :8], m(y)[0, :8], atol=1e-6)  # the future doesn't leak
    tied = Transformer(ModelConfig(**{**TINY.__dict__, "tie_embeddings": True}))
    assert tied.lm_head is None and sum(p.numel() for p in tied.parameters()) == tied.cfg.num_params()
    with pytest.raises(ValueError, match="exceeds the RoPE table"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_generate_is_deterministic_per_seed():
    m = Transformer(TINY)
    m.init_weights(0)
    a = generate(m, [1, 2, 3], 10, context=16, seed=5)
    assert a == generate(m, [1, 2, 3], 10, context=16, seed=5) and len(a) == 13 and a[:3] == [1, 2, 3]
    greedy = generate(m, [1, 2, 3], 5, context=16, temperature=0)
    assert greedy[3] == int(m(torch.tensor([[1, 2, 3]]))[0, -1].argmax())


def test_init_weights_only_fills_what_is_selected():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=40)
    model = Transformer(cfg)
    model.init_weights(seed=3)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    model.init_weights(seed=3, only=lambda n: n.endswith("q_proj.weight"))
    picked = [n for n in ref if n.endswith("q_proj.weight")]
    assert len(picked) == 2
    for n, p in model.named_parameters():
        if n in picked:
            assert torch.equal(p, ref[n])  # the same numbers as a full init
        else:
            assert bool((p == 7.0).all()), n  # untouched


def test_empty_prompt_starts_at_a_document_boundary():
    from shardlm.data.tokenizer import ByteTokenizer
    from shardlm.generate import generate, prompt_ids

    tok = ByteTokenizer()
    assert prompt_ids(tok, "") == [tok.eos_id] and prompt_ids(tok, "ab") == [97, 98]
    with pytest.raises(ValueError, match="at least one prompt token"):
        generate(torch.nn.Identity(), [], 3, context=8)
