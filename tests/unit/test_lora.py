"""LoRA: parity with peft, freezing, merging, init on the meta device, and peft adapter export."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from helpers.hf_tiny import tiny_hf_model  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from shardlm.config import TrainSection  # noqa: E402
from shardlm.interop.hf.config import config_from_hf  # noqa: E402
from shardlm.interop.hf.names import hf_state_dict_to_ours, our_state_dict_to_hf  # noqa: E402
from shardlm.interop.peft import from_peft_state_dict, peft_adapter_config, to_peft_state_dict  # noqa: E402
from shardlm.lora import (  # noqa: E402
    DEFAULT_TARGETS,
    LoRALinear,
    apply_lora,
    is_lora_param,
    lora_a_std,
    lora_state_dict,
    merge_lora,
)
from shardlm.models.llama import ModelConfig, Transformer  # noqa: E402
from shardlm.train.optim import build_optimizer  # noqa: E402

R, ALPHA = 4, 8
TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.1,
)
TOKENS = torch.randint(0, TINY["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1))
CASES = {  # (model_type, LoRA targets): all projections + the output head on Llama; q/v (with biases) on Qwen2
    "llama": ("llama", [*DEFAULT_TARGETS, "lm_head"]),
    "qwen2": ("qwen2", ["q_proj", "v_proj"]),
}


def _hf_base(model_type: str = "llama"):
    """A tiny fp32 HF causal LM, the same weights on every call."""
    return tiny_hf_model(model_type, **TINY, rope_parameters=dict(rope_type="default", rope_theta=1e4))


def _ours(hf) -> Transformer:
    cfg = config_from_hf(hf.config.to_dict())
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.load_state_dict(hf_state_dict_to_ours(hf.state_dict(), cfg), strict=True)
    model.rope.reset_parameters()
    return model.eval()


def _tiny_cfg() -> ModelConfig:
    return ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=128, max_seq_len=64)


@torch.no_grad()
def _randomise_lora(model: nn.Module, seed: int = 3) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


@torch.no_grad()
def _logits(model: nn.Module) -> torch.Tensor:
    out = model(input_ids=TOKENS) if isinstance(model, (transformers.PreTrainedModel, peft.PeftModel)) else model(TOKENS)
    return getattr(out, "logits", out)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_peft(case):
    model_type, targets = CASES[case]
    hf = _hf_base(model_type)
    ours = _ours(hf)
    base = _logits(hf)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0))
    _randomise_lora(pm)
    want = _logits(pm.eval())
    assert _max_diff(want, base) > 1e-2  # the adapter really changes the output

    names = apply_lora(ours, R, ALPHA, 0.0, targets)
    saved = peft.get_peft_model_state_dict(pm)  # what save_pretrained writes (+ lm_head's base weight if targeted)
    sd = from_peft_state_dict(saved)
    assert sd.keys() == lora_state_dict(ours).keys()
    assert len(names) == len(sd) // 2
    ours.load_state_dict(sd, strict=False)
    diff = _max_diff(_logits(ours), want)
    assert diff <= 1e-5, f"{case}: max |logit diff| vs peft {diff:.3g}"
    # and our names are exactly peft's saved names
    assert to_peft_state_dict(lora_state_dict(ours)).keys() == {k for k in saved if ".base_layer." not in k}


def test_only_lora_params_train():
    with torch.device("meta"):
        model = Transformer(_tiny_cfg())
    base_names = {n for n, _ in model.named_parameters()}
    names = apply_lora(model, R, ALPHA, 0.0, DEFAULT_TARGETS)
    assert len(names) == 2 * 7 and names[0] == "layers.0.self_attn.q_proj"
    assert {n for n, p in model.named_parameters() if not is_lora_param(n)} == base_names  # base names unchanged
    for n, p in model.named_parameters():
        assert p.requires_grad == is_lora_param(n), n
        assert p.is_meta, n

    wrapped = [model.get_submodule(n) for n in names]
    expected = sum(R * (m.in_features + m.out_features) for m in wrapped)  # A: r*in, B: out*r
    opt = build_optimizer(model, TrainSection(), torch.device("cpu"))
    seen = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert seen == expected == 2 * R * (4 * 64 + 2 * 32 + 64 + 64) + 2 * R * 3 * (64 + 128)

    # peft agrees on the count for the same model and config
    pm = peft.get_peft_model(_hf_base(), peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=DEFAULT_TARGETS))
    assert pm.get_nb_trainable_parameters()[0] == expected


def test_train_embeddings_and_norms():
    with torch.device("meta"):
        model = Transformer(_tiny_cfg())
    apply_lora(model, R, ALPHA, 0.0, ["q_proj", "lm_head"], train_embeddings=True, train_norms=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"embed_tokens.weight", "lm_head.weight", "norm.weight", "layers.1.input_layernorm.weight",
            "lm_head.lora_A.weight", "layers.0.self_attn.q_proj.lora_B.weight"} <= trainable
    assert "layers.0.self_attn.q_proj.weight" not in trainable and "layers.0.mlp.up_proj.weight" not in trainable


def test_merge_matches_unmerged():
    hf = _hf_base("qwen2")  # q/k/v biases: the merge must keep them
    model = _ours(hf)
    apply_lora(model, R, ALPHA, 0.0, DEFAULT_TARGETS)
    _randomise_lora(model)
    before = _logits(model)
    q_weight = model.layers[0].self_attn.q_proj.weight
    merged = merge_lora(model)
    assert len(merged) == 14
    assert _max_diff(_logits(model), before) <= 1e-5
    assert not any(isinstance(m, LoRALinear) or is_lora_param(n) for n, m in model.named_modules())
    q = model.layers[0].self_attn.q_proj
    assert type(q) is nn.Linear and q.weight is q_weight and q.bias is not None  # merged in place, same Parameter
    cfg = config_from_hf(hf.config.to_dict())
    assert our_state_dict_to_hf(model.state_dict(), cfg).keys() == hf.state_dict().keys()  # exports as a plain model


def test_fresh_lora_is_identity():
    model = _ours(_hf_base())
    base = _logits(model)
    apply_lora(model, R, ALPHA, 0.0, DEFAULT_TARGETS)  # on a materialised model: peft's default init
    q = model.layers[0].self_attn.q_proj
    assert torch.all(q.lora_B.weight == 0) and q.lora_A.weight.abs().max() > 0
    assert q.lora_A.weight.abs().max() <= 1 / 64**0.5  # kaiming_uniform_(a=sqrt(5)): U(+-1/sqrt(in))
    assert torch.equal(_logits(model), base)


def test_init_weights_on_meta():
    cfg = _tiny_cfg()
    with torch.device("meta"):
        plain, model = Transformer(cfg), Transformer(cfg)
    apply_lora(model, R, ALPHA, 0.0, DEFAULT_TARGETS)
    for m in (plain, model):
        m.to_empty(device="cpu")
        m.init_weights(seed=5)
    sd = model.state_dict()
    for k, v in plain.state_dict().items():  # base weights: same names, same values as without LoRA
        assert torch.equal(sd[k], v), k
    assert torch.equal(_logits(model.eval()), _logits(plain.eval()))
    by_in: dict[int, list[torch.Tensor]] = {}
    for m in model.modules():
        if isinstance(m, LoRALinear):
            assert torch.all(m.lora_B.weight == 0)
            by_in.setdefault(m.in_features, []).append(m.lora_A.weight.flatten())
    for fan_in, ws in by_in.items():  # lora_A ~ N(0, 1/sqrt(3*in)), the std of peft's kaiming_uniform
        w = torch.cat(ws)
        assert abs(w.std().item() / lora_a_std(fan_in) - 1) < 0.1, fan_in
        assert abs(w.mean().item()) < 0.2 * lora_a_std(fan_in)
    a = model.layers[0].self_attn.q_proj.lora_A.weight
    assert not torch.equal(a, model.layers[0].self_attn.k_proj.lora_A.weight[: a.shape[0]])  # per-name streams


def test_peft_export_loads(tmp_path):
    targets = ["q_proj", "v_proj", "down_proj", "lm_head"]
    ours = _ours(_hf_base())
    apply_lora(ours, R, ALPHA, 0.0, targets)
    _randomise_lora(ours, seed=7)
    want = _logits(ours)
    save_file(to_peft_state_dict(lora_state_dict(ours)), str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(peft_adapter_config(R, ALPHA, 0.0, targets)))

    cfg = peft.LoraConfig.from_pretrained(str(tmp_path))
    assert (cfg.r, cfg.lora_alpha, cfg.lora_dropout, set(cfg.target_modules)) == (R, ALPHA, 0.0, set(targets))
    pm = peft.PeftModel.from_pretrained(_hf_base(), str(tmp_path)).eval()
    diff = _max_diff(_logits(pm), want)
    assert diff <= 1e-5, f"max |logit diff| of the exported adapter {diff:.3g}"


def test_bad_targets_raise():
    with torch.device("meta"):
        model = Transformer(_tiny_cfg())
    with pytest.raises(ValueError) as e:
        apply_lora(model, R, ALPHA, 0.0, ["q_proj", "qproj", "embed_tokens"])
    msg = str(e.value)
    assert "\n" not in msg and "'qproj'" in msg and "'embed_tokens'" in msg and "'q_proj'" not in msg.split(";")[0]
    assert "valid names: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in msg
    assert not any(isinstance(m, LoRALinear) for m in model.modules())  # nothing was changed
    with pytest.raises(ValueError, match="match no nn.Linear"):
        apply_lora(model, R, ALPHA, 0.0, [])
    apply_lora(model, R, ALPHA, 0.0, ["q_proj"])
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, R, ALPHA, 0.0, ["q_proj"])


def test_peft_names():
    ours = "layers.0.self_attn.q_proj.lora_A.weight"
    theirs = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    t = torch.zeros(1)
    assert to_peft_state_dict({ours: t}) == {theirs: t}
    assert from_peft_state_dict({theirs: t}) == {ours: t}
    assert from_peft_state_dict({"base_model.model.model.layers.1.mlp.up_proj.lora_B.default.weight": t}) == {
        "layers.1.mlp.up_proj.lora_B.weight": t}
    assert to_peft_state_dict({"lm_head.lora_B.weight": t}) == {"base_model.model.lm_head.lora_B.weight": t}
    assert from_peft_state_dict({"base_model.model.lm_head.lora_B.weight": t}) == {"lm_head.lora_B.weight": t}
    with pytest.raises(ValueError, match="not a LoRA weight"):
        to_peft_state_dict({"layers.0.self_attn.q_proj.weight": t})
    assert from_peft_state_dict({"base_model.model.lm_head.base_layer.weight": t}) == {}
    with pytest.raises(ValueError, match="not a peft LoRA weight"):
        from_peft_state_dict({"model.layers.0.self_attn.q_proj.lora_A.weight": t})


def test_lora_linear_unit():
    lin = nn.Linear(8, 6)
    lora = LoRALinear.from_linear(lin, r=2, alpha=4, dropout=0.5)
    assert lora.weight is lin.weight and lora.bias is lin.bias and lora.scaling == 2.0
    assert list(dict(lora.named_parameters())) == ["weight", "bias", "lora_A.weight", "lora_B.weight"]
    assert lora.init_spec("lora_B.weight") == ("zeros",) and lora.init_spec("weight") is None
    assert lora.init_spec("lora_A.weight") == ("normal", lora_a_std(8))
    with torch.no_grad():
        lora.lora_B.weight.normal_()
    x = torch.randn(3, 8)
    torch.manual_seed(0)
    got = lora.train()(x)
    torch.manual_seed(0)
    dropped = nn.functional.dropout(x, 0.5, training=True)
    want = lin(x) + dropped @ lora.lora_A.weight.T @ lora.lora_B.weight.T * 2.0
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lora.eval()(x), lin(x) + x @ lora.lora_A.weight.T @ lora.lora_B.weight.T * 2.0)
    with torch.device("meta"):
        meta = LoRALinear.from_linear(nn.Linear(8, 6, bias=False), r=2, alpha=2)
    assert meta.bias is None and all(p.is_meta for p in meta.parameters())
