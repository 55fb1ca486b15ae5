"""QLoRA of the experts (lora.base_dtype=nf4 with gate_proj/up_proj/down_proj in lora.targets) on 2 gloo ranks.

One spawn, a tiny random Qwen3-MoE from transformers (4 experts of 128 x 128, top-2, 2 layers; per-expert files),
fp32 compute, the expert projections adapted (rank 4) and held as NF4, each rank holding 2 whole experts:
  * loaded from the HF files, each rank quantising its experts: the all-gathered projection is bitwise `to_nf4` of
    the whole stacked `(n_experts * out, in)` weight; model.init_from=dcp: gives the same bits;
  * training: the loss falls, the NF4 experts are bitwise unchanged, a run stopped at step 2 and resumed equals
    the straight run; the sharded model's logits equal a one-process fp32 model on the dequantised weights;
  * the checkpoint's NF4 pieces read back as the 3-D dequantised experts; `generate`/`eval`'s loader merges the
    adapters into them; `convert dcp-to-hf --merge-lora`'s folder loads in transformers (per-expert layout) with
    the merged model's logits.

Seen here (torch 2.13, torchao 0.18): losses 5.798, 5.807, 5.688, 5.352 (resumed: the same bits); the sharded
logits equal the reference's (0.0); transformers on the merged export equals shardlm's merged model (0.0) and
differs from the unmerged NF4 model by 7e-7.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.launch import run_ranks
from helpers.qlora import nf4_state
from helpers.whole import local, whole

pytest.importorskip("transformers")
pytest.importorskip("torchao")

STEPS, HALF = 4, 2
HF = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
          intermediate_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2, vocab_size=320,
          max_position_embeddings=128, norm_topk_prob=True)
PROJ = ("gate_proj", "up_proj", "down_proj")


def _overrides(out, store, hf, **extra) -> list[str]:
    o = {"model.init_from": f"hf:{hf}", "data.tokenizer": "bytes", "data.path": f"store:{store}", "data.seq_len": 64,
         "train.output_dir": str(out), "train.mixed_precision": "fp32", "train.micro_batch_size": 2,
         "train.lr": 1e-2, "train.warmup_steps": 1, "train.steps": STEPS, "lora.rank": 4, "lora.alpha": 8,
         "lora.base_dtype": "nf4", "lora.targets": ",".join(PROJ), "metrics.log_every": 1,
         "metrics.progress_bar": False, "train.sample_tokens": 0, "eval.interval": 0, "eval.at_end": False}
    o.update(extra)
    return [f"--{k}={v}" for k, v in o.items()]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(all(x.equal(y) for x, y in zip(a[k], b[k])) for k in a)


def _reference(cfg, mc, hf: str, adapters: dict):
    """One process: our model on the HF weights, the adapted expert projections replaced by their NF4 round trip
    (of the flat stacked weight), the given adapters, fp32."""
    import torch

    from shardlm.interop.hf.load import load_hf_weights
    from shardlm.lora import apply_lora
    from shardlm.models import Transformer
    from shardlm.quant.nf4 import nf4_roundtrip

    ref = Transformer(mc)
    apply_lora(ref, cfg.lora.rank, cfg.lora.alpha, 0.0, cfg.lora.targets)
    load_hf_weights(ref, hf)
    with torch.no_grad():
        for block in ref.layers:
            for p in PROJ:
                w = getattr(block.mlp.experts, p)
                w.copy_(nf4_roundtrip(w.reshape(-1, w.shape[-1])).view(w.shape).float())
        ref.load_state_dict(adapters, strict=False)
    return ref


def worker(tmp: str, store: str, hf: str) -> dict:
    import torch
    import torch.distributed as dist
    from helpers.runs import train_then
    from safetensors.torch import load_file

    from shardlm.build import STORED_FORMS, build_model, build_model_config
    from shardlm.checkpoint.reader import CheckpointReader
    from shardlm.config import load_config
    from shardlm.distributed.env import init_distributed
    from shardlm.lora import merge_lora
    from shardlm.parallel.dims import ParallelDims
    from shardlm.quant.nf4 import nf4_roundtrip, torchao_nf4
    from shardlm.train.trainer import Trainer

    tmp = Path(tmp)
    env = init_distributed("cpu")
    res: dict = {}
    cfg = load_config(None, _overrides(tmp / "probe", store, hf))
    mc = build_model_config(cfg, 0)
    mesh = ParallelDims(1, -1, env.world_size).build_mesh("cpu")
    hf_sd = load_file(str(Path(hf) / "model.safetensors"))

    def stacked(i: int, p: str):  # the HF per-expert tensors of layer i's projection p, flat (E * out, in)
        return torch.cat([hf_sd[f"model.layers.{i}.mlp.experts.{e}.{p}.weight"] for e in range(HF["num_experts"])])

    # -- loaded from HF: each rank quantises its 2 experts; the all-gather is to_nf4 of the whole ---------------
    model = build_model(cfg, mc, mesh, torch.device("cpu"))
    fresh = nf4_state(model)
    to_nf4 = torchao_nf4().to_nf4
    bitwise = []
    for i, block in enumerate(model.layers):
        res["local_shape"] = tuple(local(block.mlp.experts.gate_proj).shape)
        block.unshard()
        for p in PROJ:
            full, want = getattr(block.mlp.experts, p), to_nf4(stacked(i, p).to(torch.bfloat16))
            bitwise.append(type(full).__name__ == "NF4Tensor" and all(
                torch.equal(getattr(full, a), getattr(want, a)) for a in
                ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")))
        block.reshard()
    res["bitwise"] = bitwise
    dcfg = load_config(None, _overrides(tmp / "probe", store, hf, **{"model.init_from": f"dcp:{tmp / 'dcp'}"}))
    res["dcp_equal"] = _same(nf4_state(build_model(dcfg, build_model_config(dcfg, 0), mesh, torch.device("cpu"))),
                             fresh) and len(fresh) == 6

    # -- training: loss falls, NF4 experts unchanged, resume exact ----------------------------------------------
    straight, first, resumed = train_then([
        (_overrides(tmp / "straight", store, hf, **{"checkpoint.interval": 0}), None),
        (_overrides(tmp / "half", store, hf, **{"checkpoint.interval": 2}), HALF),
        (_overrides(tmp / "half", store, hf, **{"checkpoint.resume": "auto"}), None)])
    res["straight"], res["first"], res["resumed"] = straight["loss"], first["loss"], resumed["loss"]
    t = Trainer(load_config(None, _overrides(tmp / "again", store, hf, **{"train.steps": 3})))
    t.train()
    res["base_unchanged"] = _same(nf4_state(t.model), fresh)
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = t.model(x).float()
    for m in t.model.modules():
        if hasattr(m, "reshard"):
            m.reshard()
    adapters = {n: whole(p) for n, p in t.model.named_parameters() if "lora_" in n}
    res["adapted"] = sorted({n.split(".", 3)[-1] for n in adapters})
    ref = _reference(cfg, mc, hf, adapters)
    with torch.no_grad():
        res["logits_vs_reference"] = (ours - ref(x)).abs().max().item()
        merge_lora(ref)
        merged = ref(x).float()
    final = Path(t.checkpoint_dir) / "step-3"
    t.checkpointer.close()
    t.release_locks()
    # generate / eval load the checkpoint (both ranks: sharded), the NF4 experts read dequantised and merged
    from shardlm.inference import load_for_inference

    inf = load_for_inference(checkpoint=final, cfg=load_config(None, ["--train.mixed_precision=fp32",
                                                                       "--train.device=cpu"]))
    with torch.no_grad():
        res["inference_vs_merged"] = (inf.model(x).float() - merged).abs().max().item()
    del inf

    # -- the checkpoint's pieces and the merged export (rank 0; no collective) ---------------------------------
    if env.rank == 0:
        import io
        from contextlib import redirect_stdout

        import transformers

        from shardlm.interop.hf.export import export_checkpoint

        reader = CheckpointReader(final, STORED_FORMS)
        names = sorted(reader.encoded)
        got = reader.read(names)
        res["pieces"] = names
        res["pieces_read_back"] = all(
            got[n].shape == (4, 128, 128) and torch.equal(got[n].reshape(-1, 128), nf4_roundtrip(stacked(int(n.split(".")[1]), n.rsplit(".", 1)[1])))
            for n in names)
        with redirect_stdout(io.StringIO()):
            export_checkpoint(final, tmp / "merged", merge_lora=True, dtype="fp32")
        res["exported_keys"] = sorted(load_file(str(tmp / "merged" / "model.safetensors")))
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "merged", dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = hf_model(x).logits.float()
        res["export_vs_merged"] = (theirs - merged).abs().max().item()
        res["export_vs_ours"] = (theirs - ours).abs().max().item()
    dist.barrier()
    return res


@pytest.fixture(scope="module")
def res(tmp_path_factory, corpus):
    import torch
    from helpers.hf_tiny import tiny_hf_model
    from helpers.stores import text_store

    from shardlm.interop.hf.import_ import import_hf_to_dcp

    tmp = tmp_path_factory.mktemp("qlora_moe")
    hf = tiny_hf_model("qwen3_moe", **HF)
    with torch.no_grad():  # routers drawn wide: transformers starts them at zero (every expert ties)
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    hf.save_pretrained(tmp / "hf", safe_serialization=True)
    import_hf_to_dcp(tmp / "hf", tmp / "dcp")
    text = corpus.read_text()
    text_store([text[i : i + 400] for i in range(0, 40_000, 400)], tmp / "text", 0.05)
    return run_ranks(2, worker, str(tmp), str(tmp / "text"), str(tmp / "hf"))


def test_nf4_experts_gather_bitwise_to_nf4_of_the_stacked_weight(res):
    assert res["local_shape"] == (2 * 128, 128)  # 2 whole experts per rank
    assert res["bitwise"] and all(res["bitwise"]) and len(res["bitwise"]) == 6
    assert res["dcp_equal"]


def test_qlora_of_experts_trains_resumes_exactly_and_keeps_its_base(res):
    loss = res["straight"]
    assert len(loss) == STEPS and loss[STEPS] < loss[1], loss
    assert res["first"] == {k: v for k, v in loss.items() if k <= HALF}
    assert res["resumed"] == {k: v for k, v in loss.items() if k > HALF}  # bit for bit
    assert res["base_unchanged"]
    assert res["adapted"] == sorted(f"experts.lora_{ab}.{p}" for ab in "AB" for p in PROJ), res["adapted"]


def test_sharded_nf4_experts_give_the_dequantised_references_logits(res):
    assert res["logits_vs_reference"] <= 1e-5


def test_checkpoint_and_merged_export_of_nf4_experts(res):
    assert res["inference_vs_merged"] < 1e-5, res["inference_vs_merged"]
    assert res["pieces"] == [f"layers.{i}.mlp.experts.{p}" for i in range(2) for p in sorted(PROJ)]
    assert res["pieces_read_back"]
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in res["exported_keys"]
    assert res["export_vs_merged"] < 1e-4, res["export_vs_merged"]
    assert 0 < res["export_vs_ours"] < 1e-2  # fp32 rounding of (W + BAs)x against Wx + B(Ax)s

