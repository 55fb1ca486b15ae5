"""lora.base_dtype in one process: the NF4 quantiser against torchao's, shape errors, the meta model, bytes.

The sharded side (2 gloo ranks, training, resume, export) is tests/distributed/test_qlora_fsdp.py.
"""

from __future__ import annotations

import pytest
import torch

from shardlm.config import load_config
from shardlm.errors import ConfigError

pytest.importorskip("torchao")

TINY = ["--model.preset=debug", "--model.dim=256", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.ffn_dim=256", "--model.vocab_size=512", "--data.seq_len=64", "--lora.rank=4"]
INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


def _to_nf4():
    from shardlm.quant.nf4 import torchao_nf4

    return torchao_nf4().to_nf4


@pytest.mark.parametrize("shape", [(256, 256), (128, 512), (64, 1024)])
def test_quantize_whole_tensor_is_bitwise_torchao(shape):
    from shardlm.quant.nf4 import quantize_shard

    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.02
    ours, theirs = quantize_shard(w), _to_nf4()(w.to(torch.bfloat16))
    for a in INNER:
        assert torch.equal(getattr(ours, a), getattr(theirs, a)), a
    assert torch.equal(ours.get_original_weight(), theirs.get_original_weight())


def test_shards_with_the_whole_mean_concatenate_to_the_whole_tensor(monkeypatch):
    """What the all-gather reassembles: row blocks quantised with the whole tensor's scale mean, concatenated
    (as torchao's fsdp_post_all_gather does), decode bitwise as to_nf4 of the whole; with their own (local)
    means, as a naive per-rank to_nf4 would do, the int8 scales come out different."""
    import shardlm.quant.nf4 as q

    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(2))
    w[:128] *= 3  # the two halves have different scales: their local means differ
    whole = _to_nf4()(w.to(torch.bfloat16))
    absmax = w.to(torch.bfloat16).reshape(-1, 64).abs().max(dim=1).values
    # quantize_shard's all-gather of the block scales over 2 ranks, played here: it yields the whole vector
    monkeypatch.setattr(q, "_all_gather", lambda out, x, group: out.copy_(absmax))
    monkeypatch.setattr(q.dist, "get_world_size", lambda group=None: 2)
    halves = [q.quantize_shard(w[:128], group=object()), q.quantize_shard(w[128:], group=object())]
    assert all(torch.equal(h.scaler_mean, absmax.mean()) for h in halves)
    for a in ("quantized_data", "quantized_scalers", "quantization_factor"):
        assert torch.equal(torch.cat([getattr(h, a) for h in halves]), getattr(whole, a)), a
    naive = [_to_nf4()(h.to(torch.bfloat16)) for h in (w[:128], w[128:])]
    assert not torch.equal(naive[0].scaler_mean, naive[1].scaler_mean)
    assert not torch.equal(torch.cat([h.quantized_scalers for h in naive]), whole.quantized_scalers)


def test_nf4_bytes_are_what_torchao_stores():
    from shardlm.quant.nf4 import nf4_nbytes

    t = _to_nf4()(torch.randn(512, 256).to(torch.bfloat16))
    real = sum(getattr(t, a).numel() * getattr(t, a).element_size() for a in INNER)
    assert nf4_nbytes(t.numel()) == real
    assert 0.25 < real / (2 * t.numel()) < 0.26  # ~1/4 of bf16


def test_shape_errors_name_the_layer_and_the_fix():
    from shardlm.build import meta_model, build_model_config
    from shardlm.lora import nf4_targets
    from shardlm.quant.nf4 import check_shapes

    cfg = load_config(None, [*TINY, "--lora.base_dtype=nf4"])
    model = meta_model(cfg, build_model_config(cfg, 0))
    check_shapes(nf4_targets(model), 1)
    check_shapes(nf4_targets(model), 2)
    with pytest.raises(ConfigError, match=r"layers\.0\.self_attn\.k_proj\.weight \(128x256\) does not split into 4 "
                                          r"NF4 shards.*parallel\.dp_shard"):
        check_shapes(nf4_targets(model), 4)
    small = load_config(None, [*TINY, "--model.dim=128", "--model.ffn_dim=128", "--lora.base_dtype=nf4"])
    with pytest.raises(ConfigError, match=r"k_proj\.weight \(64x128\) has 8192 weights, not a multiple of 16384") \
            as e:
        check_shapes(nf4_targets(meta_model(small, build_model_config(small, 0))), 1)
    assert "\n" not in str(e.value) and "lora.base_dtype=bf16" in str(e.value)


def test_nf4_needs_lora():
    with pytest.raises(ConfigError, match=r"lora.base_dtype=nf4 .* set lora.rank > 0"):
        load_config(None, ["--lora.base_dtype=nf4"])
    with pytest.raises(ConfigError, match=r"lora.base_dtype=bf16 .* lora.rank=0 trains every weight"):
        load_config(None, ["--lora.base_dtype=bf16"])  # no frozen base: it would do nothing


def test_meta_model_stores_the_frozen_base_as_asked():
    from shardlm.build import build_model_config, meta_model
    from shardlm.quant.nf4 import is_nf4

    def dtypes(extra, device_type="cuda"):
        cfg = load_config(None, [*TINY, *extra])
        m = meta_model(cfg, build_model_config(cfg, 0), device_type)
        frozen = {("nf4" if is_nf4(p) else str(p.dtype)) for p in m.parameters() if not p.requires_grad}
        trained = {str(p.dtype) for p in m.parameters() if p.requires_grad}
        return frozen, trained

    assert dtypes([]) == ({"torch.bfloat16"}, {"torch.float32"})  # auto on a GPU: bf16
    assert dtypes([], "cpu") == ({"torch.float32"}, {"torch.float32"})  # auto on CPU: fp32 training
    assert dtypes(["--lora.base_dtype=fp32"]) == ({"torch.float32"}, {"torch.float32"})
    assert dtypes(["--lora.base_dtype=bf16", "--train.mixed_precision=fp32"]) == ({"torch.bfloat16"},
                                                                                  {"torch.float32"})
    assert dtypes(["--lora.base_dtype=nf4"]) == ({"nf4", "torch.bfloat16"}, {"torch.float32"})
    # trained norms and embeddings keep fp32 master weights
    assert dtypes(["--lora.base_dtype=bf16", "--lora.train_norms=true", "--lora.train_embeddings=true"])[1] == \
        {"torch.float32"}


def test_cast_frozen_keeps_shared_parameters_shared():
    from torch import nn

    from shardlm.lora import cast_frozen

    a, b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    b.weight = a.weight
    a.weight.requires_grad_(False)
    m = nn.Sequential(a, b)
    assert cast_frozen(m, torch.bfloat16) == ["0.weight"]
    assert m[0].weight is m[1].weight and m[0].weight.dtype == torch.bfloat16 and not m[0].weight.requires_grad


def test_state_bytes_follow_the_base_dtype():
    from shardlm.build import build_model_config, model_state_bytes

    cfg = {b: load_config(None, ["--model.preset=llama3_8b", "--lora.rank=16", f"--lora.base_dtype={b}"])
           for b in ("fp32", "bf16", "nf4")}
    mc = build_model_config(cfg["fp32"], 0)
    b = {k: model_state_bytes(c, mc) for k, c in cfg.items()}
    n = mc.num_params()
    assert 4 * n < b["fp32"] < 4.5 * n and 2 * n < b["bf16"] < 2.5 * n
    assert b["nf4"] < 0.35 * b["fp32"]  # the 7 linears per block at ~0.52 B, embeddings and head at 2


def test_plan_counts_nf4_bytes():
    """The planner's fake build holds NF4 shards of torchao's sizes: its sharded parameters shrink."""
    from shardlm.plan.fake_step import fake_step

    from shardlm.quant.nf4 import nf4_nbytes

    def sharded(base):
        cfg = load_config(None, [*TINY, "--train.mixed_precision=bf16", "--train.micro_batch_size=1",
                                 f"--lora.base_dtype={base}"])
        return fake_step(cfg, 2).peak["Sharded Param"]

    fp32, bf16, nf4 = sharded("fp32"), sharded("bf16"), sharded("nf4")
    # per rank: half the rows of 2 layers x (q, o, gate, up, down: 256x256; k, v: 128x256)
    local = [256 * 256 // 2] * 10 + [128 * 256 // 2] * 4
    # torchao's bytes for the base, to the 34 B per tensor of scaler mean and level table (not tracked)
    assert abs((bf16 - nf4) - sum(2 * n - nf4_nbytes(n) for n in local)) <= 34 * len(local)
    # fp32 -> bf16: 2 bytes less per frozen weight: the linears, embeddings + head (512x256) and 5 norms
    assert fp32 - bf16 == sum(2 * n for n in local) + 2 * (2 * 512 * 256 // 2 + 5 * 256 // 2)


def test_plan_report_names_the_base_dtype():
    from shardlm.plan import plan

    cfg = load_config(None, [*TINY, "--train.micro_batch_size=1", "--lora.base_dtype=nf4"])
    report = plan(cfg, world_size=2, gpu_mem_gib=80, gpus_per_node=2, alternatives=False)
    assert "lora.rank=4 (base nf4)" in report.format()
    assert report.base.lora_base_dtype == "nf4"
