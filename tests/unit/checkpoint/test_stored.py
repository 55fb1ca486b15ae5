"""Stored forms in one process: the NF4 form (quant/nf4.py) as checkpoint/ sees it, through CheckpointReader.

A checkpoint written here with `dcp.save(no_dist=True)` holds what a QLoRA run saves for its NF4 base (the
pieces, same key names); the sharded save / resume / export is tests/distributed/test_qlora_fsdp.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from shardlm.checkpoint.reader import SINGLE_PROCESS_WARNING, CheckpointReader
from shardlm.checkpoint.stored import StoredForm, stored_names
from shardlm.errors import CheckpointError

pytest.importorskip("torchao")


class _Model(nn.Module):
    """A plain bias and one NF4 weight, as the build leaves a QLoRA target."""

    def __init__(self):
        super().__init__()
        from shardlm.quant.nf4 import quantize_shard

        self.lin = nn.Linear(256, 64, bias=False)
        self.lin.weight = nn.Parameter(quantize_shard(torch.randn(64, 256, generator=torch.Generator().manual_seed(0))),
                                       requires_grad=False)
        self.bias = nn.Parameter(torch.arange(4.0))


def _save(path, state):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        dcp.save({"model": state}, checkpoint_id=str(path), no_dist=True)


def test_nf4_form_is_a_stored_form_and_keeps_the_key_names():
    from shardlm.quant.nf4 import NF4_FORM

    form: StoredForm = NF4_FORM
    model = _Model()
    assert stored_names(model, [form]) == {"lin.weight"} and stored_names(None, [form]) == set()
    stored = form.to_stored(model.state_dict(), model)
    assert sorted(stored) == ["bias", *(f"lin.weight.nf4.{p}" for p in ("data", "factors", "mean", "scalers",
                                                                        "shape"))]
    assert form.group(stored) == {"lin.weight": {p: f"lin.weight.nf4.{p}" for p in
                                                 ("data", "scalers", "factors", "mean", "shape")}}


def test_reader_reassembles_an_nf4_weight_and_names_incomplete_pieces(tmp_path):
    from shardlm.quant.nf4 import NF4_FORM

    model = _Model()
    stored = NF4_FORM.to_stored(model.state_dict(), model)
    _save(tmp_path / "ck", stored)
    reader = CheckpointReader(tmp_path / "ck", [NF4_FORM])
    assert set(reader.tensors) == {"bias", "lin.weight"} and set(reader.encoded) == {"lin.weight"}
    assert (reader.tensors["lin.weight"].shape, reader.tensors["lin.weight"].dtype) == ((64, 256), torch.bfloat16)
    got = reader.read(["lin.weight", "bias"])
    assert torch.equal(got["lin.weight"], model.lin.weight.get_original_weight())
    assert torch.equal(got["bias"], model.bias.detach())
    # no form handed in: the pieces are tensors of their own (the export rejects them by name)
    assert "lin.weight.nf4.data" in CheckpointReader(tmp_path / "ck").tensors
    _save(tmp_path / "bad", {k: v for k, v in stored.items() if not k.endswith(".mean")})
    with pytest.raises(CheckpointError, match=r"bad: NF4 weight 'lin.weight' is incomplete \(has \['data', "):
        CheckpointReader(tmp_path / "bad", [NF4_FORM])


def test_nf4_form_fills_from_the_plain_weight():
    """An init load (`load_dcp_weights`): the plain weight read into `plain_like` buffers, then quantised."""
    from shardlm.quant.nf4 import NF4_FORM, quantize_shard

    model, w = _Model(), torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    buf = NF4_FORM.plain_like(model, "lin.weight")
    assert (buf.shape, buf.dtype) == ((64, 256), torch.bfloat16)
    buf.copy_(w)
    NF4_FORM.fill(model, {"lin.weight": buf})
    assert torch.equal(model.lin.weight.get_original_weight(), quantize_shard(w).get_original_weight())
