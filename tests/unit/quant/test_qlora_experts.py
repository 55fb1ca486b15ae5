"""QLoRA of the experts in one process: stacked expert projections held as one flat NF4 parameter each.

The model (debug_moe with 4 experts of 128 x 128, every projection adapted) against a plain fp32 one whose adapted
weights are `to_nf4` round trips of the same init: same logits and adapter gradients; the experts' forward keeps
the 4-bit weight for the backward, not a dequantised copy; the HF files (per-expert and fused layouts) load into it
as `to_nf4` of the stacked weight; the checkpoint pieces record the 3-D shape; shapes NF4 cannot shard say so.
The sharded runs (2 gloo ranks: all-gather, training, resume, export) are tests/distributed/test_qlora_moe.py.
"""

from __future__ import annotations

import pytest
import torch

from shardlm.config import load_config
from shardlm.errors import ConfigError

pytest.importorskip("torchao")

MOE = ["--model.preset=debug_moe", "--model.n_layers=2", "--model.n_experts=4", "--model.moe_ffn_dim=128",
       "--train.mixed_precision=fp32", "--lora.rank=4", "--lora.alpha=8"]
EXPERTS = "gate_proj,up_proj,down_proj"


def _built(base_dtype: str, targets: str = f"q_proj,{EXPERTS}"):
    from shardlm.build import build_model_config, materialize_weights, meta_model

    cfg = load_config(None, [*MOE, f"--lora.base_dtype={base_dtype}", f"--lora.targets={targets}"])
    mc = build_model_config(cfg, 0)
    model = meta_model(cfg, mc, "cpu")
    materialize_weights(model, cfg, torch.device("cpu"))
    return cfg, model


def _pair():
    """(NF4 model, plain fp32 reference with every adapted weight replaced by its NF4 round trip), the same
    nonzero adapters in both."""
    from shardlm.quant.nf4 import nf4_roundtrip

    _, q = _built("nf4")
    _, ref = _built("fp32")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for (n, p), (n2, p2) in zip(q.named_parameters(), ref.named_parameters()):
            assert n == n2
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
                p2.copy_(p)
        for name, m in ref.named_modules():
            if hasattr(m, "lora_A") and m.lora_A is not None:
                for attr in (m.lora_A.keys() if hasattr(m.lora_A, "keys") else ["weight"]):
                    w = getattr(m, attr)
                    w.copy_(nf4_roundtrip(w.reshape(-1, w.shape[-1])).view(w.shape).float())
    return q, ref


def test_nf4_experts_give_the_round_tripped_models_logits_and_gradients():
    from shardlm.quant.nf4 import is_nf4

    q, ref = _pair()
    experts = q.layers[0].mlp.experts
    assert all(is_nf4(getattr(experts, p)) and getattr(experts, p).shape == (4 * 128, 128)
               for p in ("gate_proj", "up_proj", "down_proj"))
    assert experts.logical_shapes == {"gate_proj": (4, 128, 128), "up_proj": (4, 128, 128), "down_proj": (4, 128, 128)}
    x = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    out, want = q(x), ref(x)
    assert (out - want).abs().max().item() < 1e-5
    out.float().pow(2).mean().backward()
    want.float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in q.named_parameters() if p.requires_grad}
    assert any("experts.lora_A" in n for n in grads) and any("q_proj.lora_B" in n for n in grads)
    for n, p in ref.named_parameters():
        if p.requires_grad:
            assert torch.allclose(grads[n], p.grad, rtol=1e-4, atol=1e-7), n


def test_the_experts_forward_keeps_the_4bit_weight_not_a_dequantised_copy():
    """What autograd saves during the experts' forward: activations and the NF4 object, nothing the size of a
    projection's dequantised weight (4 x 128 x 128 bf16 = 128 KiB)."""
    q, ref = _pair()
    x = torch.randn(64, 128, requires_grad=True)
    expert = torch.stack([torch.arange(64) % 4, (torch.arange(64) + 1) % 4], 1)
    weight = torch.full((64, 2), 0.5)

    def saved(experts) -> int:
        sizes = []

        def pack(t):
            sizes.append(t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            experts(x, expert, weight).sum().backward()
        return max(sizes)

    weight_bytes = 4 * 128 * 128 * 2
    assert saved(q.layers[0].mlp.experts) < weight_bytes
    assert saved(ref.layers[0].mlp.experts) >= weight_bytes  # the plain weight is saved (the check can fail)


def test_hf_experts_load_as_nf4_of_the_stacked_weight(tmp_path):
    """Per-expert files (one tensor per expert) and the fused layout: each projection is `to_nf4` of the stacked
    `(n_experts * out, in)` weight in bf16, bit for bit."""
    pytest.importorskip("transformers")
    from helpers.hf_tiny import tiny_hf_model
    from safetensors.torch import save_file

    from shardlm.build import build_model_config, materialize_weights, meta_model
    from shardlm.quant.nf4 import torchao_nf4

    hf = tiny_hf_model("qwen3_moe", hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, intermediate_size=256, moe_intermediate_size=128, num_experts=4,
                       num_experts_per_tok=2, vocab_size=320, max_position_embeddings=64, norm_topk_prob=True)
    hf.save_pretrained(tmp_path / "per_expert", safe_serialization=True)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    (tmp_path / "fused").mkdir()
    save_file(sd, str(tmp_path / "fused" / "model.safetensors"))
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "per_expert" / "config.json").read_text())
    to_nf4 = torchao_nf4().to_nf4
    for folder in ("per_expert", "fused"):
        cfg = load_config(None, ["--train.mixed_precision=fp32", "--lora.rank=4", "--lora.base_dtype=nf4",
                                 f"--lora.targets={EXPERTS}", f"--model.init_from=hf:{tmp_path / folder}"])
        model = meta_model(cfg, build_model_config(cfg, 0), "cpu")
        materialize_weights(model, cfg, torch.device("cpu"))
        for i in range(2):
            pre = f"model.layers.{i}.mlp.experts"
            gate, up = sd[f"{pre}.gate_up_proj"].chunk(2, dim=1)
            for p, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", sd[f"{pre}.down_proj"])):
                got = getattr(model.layers[i].mlp.experts, p)
                want = to_nf4(w.reshape(-1, w.shape[-1]).to(torch.bfloat16))
                assert torch.equal(got.quantized_data, want.quantized_data), (folder, i, p)
                assert torch.equal(got.get_original_weight(), want.get_original_weight()), (folder, i, p)


def test_checkpoint_pieces_hold_the_experts_3d_shape():
    from shardlm.quant.nf4 import NF4_FORM, from_pieces

    _, q = _built("nf4", EXPERTS)
    stored = NF4_FORM.to_stored(q.state_dict(), q)
    name = "layers.1.mlp.experts.down_proj"
    assert stored[f"{name}.nf4.shape"].tolist() == [4, 128, 128]
    assert stored["layers.1.self_attn.q_proj.weight"].shape == (128, 128)  # not adapted here: plain
    pieces = {k.rpartition(".")[2]: v for k, v in stored.items() if k.startswith(f"{name}.nf4.")}
    whole = from_pieces(pieces)
    w = q.get_parameter(name)
    assert whole.shape == (4, 128, 128) and torch.equal(whole, w.get_original_weight().view(4, 128, 128))
    buf = NF4_FORM.plain_like(q, name)
    assert (buf.shape, buf.dtype) == ((4, 128, 128), torch.bfloat16)


def test_shapes_nf4_cannot_hold_per_expert_say_so():
    from shardlm.build import build_model_config, meta_model
    from shardlm.lora import nf4_targets
    from shardlm.quant.nf4 import check_shapes

    cfg = load_config(None, [*MOE, "--lora.base_dtype=nf4", f"--lora.targets={EXPERTS}"])
    model = meta_model(cfg, build_model_config(cfg, 0), "cpu")
    check_shapes(nf4_targets(model), 4)
    with pytest.raises(ConfigError, match=r"layers\.0\.mlp\.experts\.\w+_proj \(4 experts of 128x128\) does not split "
                                          r"into 8 NF4 shards of whole experts; use a parallel\.dp_shard that divides 4 "
                                          r"\(1, 2, 4\) with parallel\.dp_replicate") as e:
        check_shapes(nf4_targets(model), 8)
    assert "\n" not in str(e.value)
    small = load_config(None, [*MOE[:3], "--model.moe_ffn_dim=48", *MOE[4:], "--lora.base_dtype=nf4",
                               f"--lora.targets={EXPERTS}"])
    with pytest.raises(ConfigError, match=r"experts\.down_proj \(4 experts of 128x48\): an expert's 6144 weights are "
                                          r"not a multiple of 16384.*drop down_proj from lora\.targets"):
        check_shapes(nf4_targets(meta_model(small, build_model_config(small, 0), "cpu")), 1)
