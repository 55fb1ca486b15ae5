"""FP8 wiring that CPU can check: which linears become float8, and that the float8 all-gather path
(NCCL only: gloo has no float8 all-gather) is switched on exactly for tensorwise on CUDA, with the
weights torchao needs for it. The float8 training itself runs on 2 gloo ranks in
tests/distributed/test_precision.py; the all-gather on a GPU in benchmarks/gpu_mfu.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")

from shardlm.models import ModelConfig, Transformer  # noqa: E402
from shardlm.quant.fp8 import apply_fp8, fp8_all_gather  # noqa: E402


def test_float8_all_gather_only_for_tensorwise_on_cuda():
    assert fp8_all_gather("tensorwise", torch.device("cuda"))
    assert not fp8_all_gather("rowwise", torch.device("cuda"))  # per-row scales: torchao all-gathers bf16
    assert not fp8_all_gather("tensorwise", torch.device("cpu"))  # gloo: "Invalid scalar type"


def _model():
    torch.manual_seed(0)
    return Transformer(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=50))


@pytest.mark.parametrize("all_gather", [True, False])
def test_apply_fp8_converts_eligible_linears(all_gather):
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    model = _model()
    names = apply_fp8(model, "tensorwise", emulate=True, all_gather=all_gather)
    f8 = {n: m for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert sorted(f8) == sorted(names)
    # q/k/v/o (64 -> 64/32) and gate/up/down (64 <-> 176 = 11 x 16) in both blocks; never the head
    assert len(f8) == 14 and not any(n.endswith("lm_head") for n in f8)
    for m in f8.values():
        assert m.config.enable_fsdp_float8_all_gather is all_gather
        assert isinstance(m.weight, WeightWithDynamicFloat8CastTensor) is all_gather


def test_apply_fp8_skips_shapes_not_multiple_of_16():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=100, vocab_size=50))
    names = apply_fp8(model, "rowwise", emulate=True, all_gather=False)
    assert sorted(n.rsplit(".", 1)[1] for n in names) == ["k_proj", "o_proj", "q_proj", "v_proj"]  # ffn 100: skipped
