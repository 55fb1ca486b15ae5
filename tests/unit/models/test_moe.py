"""Mixtures of experts against transformers: Qwen3-MoE, Mixtral and Qwen2-MoE (a shared expert).

One tiny random model per family, made by transformers and saved with `save_pretrained` (the published
per-expert layout) and as its in-memory fused layout (`mlp.experts.gate_up_proj`): shardlm's logits (fp32,
1e-5) from both folders, from `convert hf-to-dcp`, and after `convert dcp-to-hf` in both layouts back in
transformers; greedy decoding token for token; the load-balancing loss and its router gradient; the dispatch
against a per-token reference; the presets' total and active parameter counts against the published ones.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.hf_tiny import tiny_hf_model  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from shardlm.interop.hf.config import config_from_hf, config_to_hf  # noqa: E402
from shardlm.models.llama import ModelConfig, Transformer  # noqa: E402
from shardlm.models.moe import Experts, RouterBalance, grouped_linear, set_router_balance  # noqa: E402
from shardlm.models.presets import PRESETS  # noqa: E402

BASE = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
            max_position_embeddings=64, rms_norm_eps=1e-6, num_experts_per_tok=2, initializer_range=0.1,
            rope_parameters=dict(rope_type="default", rope_theta=1e4))
FAMILIES = {
    # Qwen3-MoE with a dense layer between sparse ones (mlp_only_layers) and renormalised top-k
    "qwen3_moe": dict(head_dim=8, intermediate_size=40, moe_intermediate_size=16, num_experts=6, mlp_only_layers=[1],
                      norm_topk_prob=True),
    # Mixtral: every layer sparse, softmax over the top-k
    "mixtral": dict(intermediate_size=16, num_local_experts=4, sliding_window=None),
    # Qwen2-MoE: a shared expert with its sigmoid gate, top-k not renormalised, every 2nd layer sparse
    "qwen2_moe": dict(intermediate_size=40, moe_intermediate_size=16, num_experts=4, shared_expert_intermediate_size=24,
                      norm_topk_prob=False, decoder_sparse_step=2),
}
TOKENS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))


def _hf(family: str, **extra):
    model = tiny_hf_model(family, **BASE, **FAMILIES[family], **extra)
    with torch.no_grad():  # routers drawn wide: transformers starts some at zero (every expert ties)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, HF model, its per-expert folder, its fused folder)."""
    name = request.param
    hf = _hf(name)
    d = tmp_path_factory.mktemp(name)
    hf.save_pretrained(d / "per_expert", safe_serialization=True)
    (d / "fused").mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(d / "fused" / "model.safetensors"))
    (d / "fused" / "config.json").write_text((d / "per_expert" / "config.json").read_text())
    return name, hf, d / "per_expert", d / "fused"


def _load(folder) -> Transformer:
    from shardlm.inference import load_for_inference

    return load_for_inference(hf=folder, tokenizer="bytes").model


def _keys(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_logits_equal_transformers_from_both_layouts(family):
    name, hf, per_expert, fused = family
    keys = _keys(per_expert)
    expert = "block_sparse_moe.experts.3.w2.weight" if name == "mixtral" else "mlp.experts.3.down_proj.weight"
    layer = 1 if name == "qwen2_moe" else 0  # its first sparse layer
    assert f"model.layers.{layer}.{expert}" in keys and not any("gate_up_proj" in k for k in keys)
    assert f"model.layers.{layer}.mlp.experts.gate_up_proj" in _keys(fused)
    with torch.no_grad():
        want = hf(input_ids=TOKENS).logits
        for folder in (per_expert, fused):
            got = _load(folder)(TOKENS)
            assert (got - want).abs().max().item() <= 1e-5, (name, folder.name)
    assert want.abs().max() > 0.1


def test_config_round_trip_and_counts(family):
    name, hf, _, _ = family
    cfg = config_from_hf(hf.config.to_dict())
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    assert config_from_hf(config_to_hf(cfg)) == cfg
    assert cfg.n_moe_layers == {"qwen3_moe": 2, "mixtral": 3, "qwen2_moe": 1}[name]
    assert 0 < cfg.num_params(active=True) < cfg.num_params()


def test_greedy_equals_transformers_generate(family, tmp_path):
    from shardlm.generate import generate_batch
    from shardlm.inference import load_for_inference
    from shardlm.interop.hf.import_ import import_hf_to_dcp

    name, hf, per_expert, _ = family
    import_hf_to_dcp(per_expert, tmp_path / "ck")
    prompts = [[5, 9, 2, 33, 7, 1, 18, 40, 250, 3, 77], [11, 12, 13]]
    for source in ({"hf": per_expert}, {"checkpoint": tmp_path / "ck"}):
        inf = load_for_inference(**source, tokenizer="bytes")
        got = generate_batch(inf.model, prompts, 16, stop_ids=inf.stop_ids, context=inf.context)
        for p, c in zip(prompts, got):
            with torch.no_grad():
                want = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                   eos_token_id=list(inf.stop_ids), pad_token_id=0)[0, len(p):].tolist()
            assert c.ids == want, (name, source, p)


def test_export_in_both_layouts_loads_in_transformers(family, tmp_path):
    from shardlm.interop.hf.export import export_hf
    from shardlm.interop.hf.import_ import import_hf_to_dcp

    name, hf, per_expert, _ = family
    import_hf_to_dcp(per_expert, tmp_path / "ck")
    with torch.no_grad():
        want = hf(input_ids=TOKENS).logits
    for layout in ("per-expert", "fused"):
        out = tmp_path / layout
        export_hf(tmp_path / "ck", out, dtype="fp32", expert_layout=layout, max_shard_bytes=40_000, log=lambda _: None)
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert any("gate_up_proj" in k for k in index) == (layout == "fused")
        assert len(set(index.values())) > 1  # several files
        back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            assert (back(input_ids=TOKENS).logits - want).abs().max().item() <= 1e-5, (name, layout)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_aux_loss_and_router_gradient_equal_transformers(name, tmp_path):
    hf = _hf(name, output_router_logits=True, router_aux_loss_coef=0.05).train()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = _load(tmp_path).train()
    cfg = ours.cfg
    assert cfg.router_aux_loss_coef == 0.05
    balance = RouterBalance(cfg.n_experts, cfg.n_experts_per_tok, cfg.router_aux_loss_coef)
    assert set_router_balance(ours, balance) == cfg.n_moe_layers
    labels = torch.cat([TOKENS[:, 1:], torch.full((2, 1), -100)], 1)
    out = hf(input_ids=TOKENS, labels=TOKENS)
    ce = ours(TOKENS, labels=labels) / (labels != -100).sum()
    assert abs(balance.aux_loss().item() - out.aux_loss.item()) <= 1e-6
    assert abs(balance.aux_loss().item() - 1.0) > 1e-3  # not the perfectly balanced value: a real check
    out.loss.backward()
    ce.backward()  # the balance loss enters through the MoE layers' backward
    router = "model.layers.0.mlp.gate.weight"
    g_hf = dict(hf.named_parameters())[router].grad
    g_us = ours.layers[0].mlp.gate.weight.grad
    torch.testing.assert_close(g_us, g_hf, rtol=0, atol=1e-7)
    balance.aux_coef = 0.0  # without the loss the router's gradient differs: the attachment does something
    ours.zero_grad()
    balance.reset()
    ours(TOKENS, labels=labels).div((labels != -100).sum()).backward()
    assert (ours.layers[0].mlp.gate.weight.grad - g_hf).abs().max() > 1e-5


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_padding_is_left_out_of_the_aux_loss_as_hfs_attention_mask_does(name, tmp_path):
    """Right-padded rows (SFT): with `token_mask` the aux loss and the router's gradient equal transformers' given
    the attention mask; counting the padding (no mask) gives another loss."""
    hf = _hf(name, output_router_logits=True, router_aux_loss_coef=0.05).train()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = _load(tmp_path).train()
    cfg = ours.cfg
    balance = RouterBalance(cfg.n_experts, cfg.n_experts_per_tok, cfg.router_aux_loss_coef)
    set_router_balance(ours, balance)
    real = torch.arange(TOKENS.shape[1])[None, :] < torch.tensor([[30], [25]])  # rows of 30 and 25 tokens
    hf_labels = TOKENS.masked_fill(~real, -100)
    labels = torch.cat([hf_labels[:, 1:], torch.full((2, 1), -100)], 1)
    out = hf(input_ids=TOKENS, attention_mask=real.long(), labels=hf_labels)
    balance.token_mask = real.reshape(-1)
    ce = ours(TOKENS, labels=labels) / (labels != -100).sum()
    assert abs(balance.aux_loss().item() - out.aux_loss.item()) <= 1e-6
    out.loss.backward()
    ce.backward()
    router = "model.layers.0.mlp.gate.weight"
    torch.testing.assert_close(ours.layers[0].mlp.gate.weight.grad, dict(hf.named_parameters())[router].grad,
                               rtol=0, atol=1e-7)
    balance.reset()
    balance.token_mask = None
    ours(TOKENS, labels=labels)
    assert abs(balance.aux_loss().item() - out.aux_loss.item()) > 1e-4  # the padding counted: another loss
    balance.token_mask = torch.ones(7, dtype=torch.bool)
    with pytest.raises(ValueError, match="token_mask has shape"):
        ours(TOKENS, labels=labels)


def test_dispatch_equals_a_per_token_reference_and_gives_idle_experts_zero_grads():
    torch.manual_seed(0)
    ex = Experts(5, 8, 6)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(7, 8, requires_grad=True)
    expert = torch.tensor([[0, 2], [2, 0], [1, 2], [0, 1], [2, 1], [0, 2], [1, 0]])  # expert 3, 4: no tokens
    weight = torch.rand(7, 2)
    got = ex(x, expert, weight)
    want = torch.zeros(7, 8)
    for t in range(7):
        for s in range(2):
            e = expert[t, s]
            h = torch.nn.functional.silu(x[t] @ ex.gate_proj[e].T) * (x[t] @ ex.up_proj[e].T)
            want[t] += weight[t, s] * (h @ ex.down_proj[e].T)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.sum().backward()
    assert ex.gate_proj.grad[3:].abs().max() == 0 and ex.gate_proj.grad[:3].abs().min(0).values.max() > 0
    empty = grouped_linear(torch.zeros(0, 8), ex.gate_proj, [0] * 5, None)
    assert empty.shape == (0, 6)


@pytest.mark.parametrize("name, total, active", [
    ("qwen3_30b_a3b", 30.5e9, 3.3e9), ("qwen3_235b_a22b", 235e9, 22e9),
    ("mixtral_8x7b", 46.7e9, 12.9e9), ("mixtral_8x22b", 141e9, 39e9),
])
def test_presets_have_the_published_total_and_active_counts(name, total, active):
    cfg = PRESETS[name]
    assert abs(cfg.num_params() / total - 1) < 0.01 and abs(cfg.num_params(active=True) / active - 1) < 0.02
    assert config_from_hf(config_to_hf(cfg), max_seq_len=cfg.max_seq_len) == cfg
    attention = 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 4096
    assert cfg.flops_per_token(4096) == 6.0 * cfg.num_params(exclude_embedding=True, active=True) + attention  # MFU


def test_bad_moe_configs_are_one_line():
    with pytest.raises(ValueError, match="n_experts_per_tok"):
        ModelConfig(dim=8, n_layers=1, n_heads=2, vocab_size=8, ffn_dim=8, n_experts=4, n_experts_per_tok=5,
                    moe_ffn_dim=4)
    hf = config_to_hf(PRESETS["mixtral_8x7b"])
    with pytest.raises(ValueError, match="router_jitter_noise"):
        config_from_hf({**hf, "router_jitter_noise": 0.1})
    with pytest.raises(ValueError, match="cannot represent a model with 128 experts"):
        config_to_hf(PRESETS["qwen3_30b_a3b"], "qwen3")


def test_router_coefficients_override_an_hf_model_but_its_shape_does_not(family):
    """model.router_aux_loss_coef changes training, not the checkpoint: allowed with model.init_from (and the load's
    config check lets it through); an expert-count override of a loaded model is one line."""
    import dataclasses

    from shardlm.build import build_model_config
    from shardlm.config import load_config
    from shardlm.errors import ConfigError
    from shardlm.interop.hf.load import load_hf_weights

    _, _, per_expert, _ = family
    cfg = load_config(None, [f"--model.init_from=hf:{per_expert}", "--model.router_aux_loss_coef=0.5",
                             "--model.router_z_loss_coef=0.01", "--data.seq_len=64"])
    mc = build_model_config(cfg, 0)
    assert (mc.router_aux_loss_coef, mc.router_z_loss_coef) == (0.5, 0.01) and mc.n_experts
    model = Transformer(dataclasses.replace(mc))
    model.rope.reset_parameters()
    assert load_hf_weights(model, per_expert) == []
    with pytest.raises(ConfigError, match="model.n_experts cannot change the shape"):
        build_model_config(load_config(None, [f"--model.init_from=hf:{per_expert}", "--model.n_experts=2"]), 0)


def test_qlora_startup_line_names_the_experts_left_unquantised():
    """lora.base_dtype=nf4 quantises the adapted weights only: experts' projections outside lora.targets keep the
    frozen dtype, and the startup line's trainable note names them; with every projection adapted (or a dense
    model) it says nothing of experts."""
    pytest.importorskip("torchao")
    from shardlm.build import build_model_config, meta_model
    from shardlm.config import load_config
    from shardlm.observe.report import trainable_note

    def note(preset, targets):
        cfg = load_config(None, [f"--model.preset={preset}", "--lora.rank=4", "--lora.base_dtype=nf4",
                                 f"--lora.targets={targets}", *(["--model.moe_ffn_dim=128"] * (preset != "debug"))])
        model = meta_model(cfg, build_model_config(cfg, 0))
        return trainable_note(cfg, model, [p for p in model.parameters() if p.requires_grad], "nf4")

    got = note("debug_moe", "q_proj,v_proj")
    assert "LoRA r=4, base nf4 (experts' gate_proj,up_proj,down_proj: bfloat16, not in lora.targets" in got, got
    got = note("debug_moe", "q_proj,up_proj")
    assert "(experts' gate_proj,down_proj: bfloat16, not in lora.targets so not NF4)" in got, got
    for preset, targets in (("debug_moe", "q_proj,gate_proj,up_proj,down_proj"), ("debug", "q_proj,v_proj")):
        got = note(preset, targets)
        assert "LoRA r=4, base nf4" in got and "experts" not in got, got


def test_merging_lora_of_experts_keeps_the_logits(family):
    """`merge_lora` folds the stacked experts' adapters (W[e] += B[e] @ A[e] * alpha/r, the one `lora_delta`) as
    it folds the linears': the same logits, no adapter left, every adapted expert projection named."""
    from shardlm.lora import DEFAULT_TARGETS, apply_lora, is_lora_param, merge_lora

    name, _, per_expert, _ = family
    model = _load(per_expert)
    apply_lora(model, 4, 8.0, 0.0, DEFAULT_TARGETS)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        before = model(TOKENS)
        k, experts = next((k, layer.mlp.experts) for k, layer in enumerate(model.layers) if hasattr(layer.mlp, "experts"))
        base = experts.gate_proj.clone()
        merged = merge_lora(model)
        after = model(TOKENS)
    assert f"layers.{k}.mlp.experts.down_proj" in merged and not any(is_lora_param(n) for n, _ in model.named_parameters())
    assert not torch.equal(experts.gate_proj, base)  # the adapters really were non-zero
    assert (after - before).abs().max().item() <= 1e-5 * before.abs().max().item()
