"""QLoRA under HSDP (2 replicas x 2 shards, 4 gloo ranks): each replica's shard group quantises its own rows
with the scale mean of the whole weight (the all-gather of the block scales runs over the shard dimension
only), the gathered NF4 weight is bitwise `to_nf4` of the whole one on every rank, and 3 training steps run
(finite losses). One spawn."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.launch import run_ranks
from helpers.whole import local
from helpers.qlora import make_hf, qlora_overrides
from helpers.runs import train_then

pytest.importorskip("transformers")
pytest.importorskip("torchao")


def worker(tmp: str, corpus: str, hf: str) -> dict:
    import torch
    from safetensors.torch import load_file

    from shardlm.build import build_model, build_model_config
    from shardlm.config import load_config
    from shardlm.distributed.env import init_distributed
    from shardlm.interop.hf.names import our_key_to_hf
    from shardlm.parallel.dims import ParallelDims
    from shardlm.quant.nf4 import torchao_nf4

    env = init_distributed("cpu")
    hsdp = {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "train.steps": 3}
    cfg = load_config(None, qlora_overrides(Path(tmp) / "probe", corpus, hf, **hsdp))
    mc = build_model_config(cfg, 0)
    model = build_model(cfg, mc, ParallelDims(2, 2, env.world_size).build_mesh("cpu"), torch.device("cpu"))
    sd = {}
    for f in sorted(Path(hf).glob("*.safetensors")):
        sd.update(load_file(f))
    bitwise = []
    for i, block in enumerate(model.layers):
        block.unshard()
        for name, m in block.named_modules():
            if hasattr(m, "lora_A"):
                ref = torchao_nf4().to_nf4(sd[our_key_to_hf(f"layers.{i}.{name}.weight")].to(torch.bfloat16))
                bitwise.append(torch.equal(m.weight.quantized_data, ref.quantized_data)
                               and torch.equal(m.weight.get_original_weight(), ref.get_original_weight()))
        block.reshard()
    (run,) = train_then([(qlora_overrides(Path(tmp) / "run", corpus, hf, **hsdp), None)])
    return {"bitwise": bitwise, "loss": run["loss"], "shard_rows": local(model.layers[0].mlp.down_proj.weight).shape}


def test_qlora_under_hsdp(tmp_path, corpus):
    hf = make_hf(tmp_path / "hf")
    out = run_ranks(4, worker, str(tmp_path), str(corpus), str(hf))
    assert len(out["bitwise"]) == 14 and all(out["bitwise"])
    assert tuple(out["shard_rows"]) == (128, 256)  # sharded over the 2 ranks of a replica, not 4
    loss = out["loss"]
    assert len(loss) == 3 and all(v == v for v in loss.values())
