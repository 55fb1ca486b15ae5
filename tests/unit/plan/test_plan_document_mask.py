"""The planner with document masks (data.document_mask): positions in the micro-batches, the mask's memory,
the attention it assumes (`shardlm.plan.attention`).

Against a real run: tests/distributed/test_plan_accuracy_document_mask.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from shardlm.cli import main
from shardlm.config import load_config
from shardlm.errors import ConfigError
from shardlm.plan import plan
from shardlm.plan.attention import FLEX_NOTE, FlexMemory, block_mask, positions
from shardlm.plan.fake_step import model_config

B, T = 4, 512
SEQ = ("--model.preset=debug", "--train.mixed_precision=fp32", f"--train.micro_batch_size={B}", f"--data.seq_len={T}")


def _plan(*overrides: str, attention: str = "auto", **kw):
    return plan(load_config(None, list(overrides)), world_size=2, gpu_mem_gib=80, gpus_per_node=2,
                alternatives=False, document_attention=attention, **kw)


def test_dense_mask_is_planned_as_sdpa_keeps_it():
    """sdpa-mask at seq 512: SDPA turns the bool mask into an fp32 additive mask in every layer and keeps it for
    the layer's backward (the bool mask itself is gone by then); RoPE takes per-token cos/sin; positions are input."""
    causal = _plan(*SEQ)
    dense = _plan(*SEQ, "--data.document_mask=true", attention="sdpa-mask")
    mc, _ = model_config(load_config(None, list(SEQ)))
    float_masks = mc.n_layers * B * T * T * 4
    cos_sin, pos = 2 * B * T * mc.head_dim * 4, B * T * 8
    assert dense.base.peak.total - causal.base.peak.total == float_masks + cos_sin + pos
    assert dense.document_attention.startswith("sdpa-mask: SDPA with a dense (B, 1, T, T) mask")
    assert "document masks (sdpa-mask: " in dense.format() and "document masks" not in causal.format()
    assert json.loads(causal.to_json())["document_attention"] is None
    assert not any("flex" in n for n in dense.notes)


def test_dense_mask_under_full_ac_lives_once():
    """train.ac=full: the bool mask is a block input kept for the recomputation; each block's float mask is
    rebuilt in its backward, one at a time: the cost does not grow with the layers."""
    extra, t = {}, T // 2
    for n in (2, 4):
        ov = (*SEQ, f"--data.seq_len={t}", f"--model.n_layers={n}", "--train.ac=full")
        extra[n] = (_plan(*ov, "--data.document_mask=true", attention="sdpa-mask").base.peak.total
                    - _plan(*ov).base.peak.total)
    hd = model_config(load_config(None, list(SEQ)))[0].head_dim
    assert extra[2] == extra[4] == B * t * t * (1 + 4) + 2 * B * t * hd * 4 + B * t * 8  # bool + one fp32 mask


def test_flex_is_assumed_for_gpus_and_planned_by_its_kernels_tensors():
    pytest.importorskip("torch.nn.attention.flex_attention")
    causal = _plan(*SEQ)
    flex = _plan(*SEQ, "--data.document_mask=true")
    dense = _plan(*SEQ, "--data.document_mask=true", attention="sdpa-mask")
    assert flex.document_attention.startswith("flex: compiled flex attention") and FLEX_NOTE in flex.notes
    assert "document masks (flex: " in flex.format()
    # no O(T^2) term: within a few percent of causal SDPA (flex does GQA in the kernel: no repeated k/v)
    assert abs(flex.base.peak.total - causal.base.peak.total) < 0.05 * causal.base.peak.total
    assert dense.base.peak.total - flex.base.peak.total > 4 * B * T * T * 4 * 0.9


def test_flex_stand_ins_have_torchs_shapes():
    """`block_mask` gives create_block_mask's tensors (shapes, dtypes); `FlexMemory` flex attention's outputs
    and gradients (GQA: k/v-shaped)."""
    create_block_mask = pytest.importorskip("torch.nn.attention.flex_attention").create_block_mask

    from shardlm.models.llama import document_mask_mod, document_segments

    mod = document_mask_mod(document_segments(positions(3, 300, torch.device("cpu"), doc_len=100)))
    real, ours = create_block_mask(mod, 3, None, 300, 300, device="cpu"), block_mask(mod, 3, None, 300, 300)

    def shapes(bm):
        return [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in bm.as_tuple()[:-1]]

    assert shapes(ours) == shapes(real) and ours.shape == real.shape
    q = torch.randn(3, 4, 300, 16, requires_grad=True)
    k, v = (torch.randn(3, 2, 300, 16, requires_grad=True) for _ in range(2))
    out = FlexMemory.apply(q, k, v, *[x for x in ours.as_tuple() if isinstance(x, torch.Tensor)])
    assert out.shape == q.shape and out.dtype == q.dtype
    out.sum().backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)


def test_extrapolated_plan_equals_every_layer_with_document_masks(monkeypatch):
    """The dense masks are per block (one per layer) and the bool mask the root's: affine in the layers, like the
    rest (flex's few extra tensors too: checked by hand, left out for time)."""
    import shardlm.plan.extrapolate as X

    monkeypatch.setattr(X, "MIN_SAVING", -100)  # extrapolate a small model too
    cfg = load_config(None, ["--model.preset=debug", "--model.n_layers=13", "--data.seq_len=64",
                             "--train.micro_batch_size=2", "--data.document_mask=true"])
    fast = plan(cfg, 2, 80, alternatives=False, document_attention="sdpa-mask")
    full = plan(cfg, 2, 80, alternatives=False, document_attention="sdpa-mask", exact=True)
    assert not any("ran all" in n for n in fast.notes) and fast.base.peak.raw == full.base.peak.raw


def test_cli_option(capsys):
    rc = main(["plan", "--nodes=1", "--gpus-per-node=2", "--gpu-mem-gib=80", "--no-alternatives", "--json",
               "--document-attention=sdpa-mask", "--model.preset=debug", "--model.n_layers=2",
               "--data.seq_len=64", "--data.document_mask=true"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["document_attention"].startswith("sdpa-mask: ")
    with pytest.raises(ConfigError, match="document attention must be one of"):
        _plan("--model.preset=debug", attention="dense")
