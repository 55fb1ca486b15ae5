"""QLoRA (lora.base_dtype=nf4) and the bf16 frozen base on 2 real gloo ranks, against unsharded references.

One spawn runs, on a tiny HF llama (dim 256, 2 layers, ~0.95M parameters, seq 64, fp32 compute):
  * NF4 from HF, each rank quantising its own rows: the all-gathered weights are bitwise `to_nf4` of the
    whole bf16 weight; the all-gathers move NF4 bytes, not bf16; each rank's base is ~1/4 of bf16;
  * the logits of the sharded NF4 model equal a plain one-process model built on the dequantised weights;
  * training: the loss falls, the NF4 base is bitwise unchanged, save at step 4 + resume = straight run;
    a checkpoint (also an async one) holds the NF4 pieces, read back as the dequantised base;
  * `convert dcp-to-hf --merge-lora` of the final checkpoint loads in transformers, matches our logits;
  * adapters_only checkpoints hold no base; a random init and model.init_from=dcp: quantise per shard too;
  * lora.base_dtype=bf16: the frozen bytes per rank halve and the losses match the fp32 base.

Seen here (torch 2.13, torchao 0.18): per rank the NF4 base takes 203,276 B where bf16 takes 786,432 B
(0.258); one forward all-gathers 639,536 B = 202,800 B of NF4 pieces + 436,736 B of the fp32 rest, exactly;
the sharded NF4 model's logits equal the reference's (0.0), transformers on the merged export equals
shardlm's merged model (0.0) and differs from the unmerged NF4 model by 2e-4 (|logits| ~14: fp32 rounding
of (W + BAs)x vs Wx + B(Ax)s); frozen bytes per rank 1,903,104 (fp32) vs 951,552 (bf16).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.launch import run_ranks
from helpers.qlora import STEPS, make_hf, nf4_reference, nf4_state, qlora_overrides
from helpers.runs import train_then
from helpers.whole import local, whole

pytest.importorskip("transformers")
pytest.importorskip("torchao")

HALF = 4


def _gathered_bytes(model, x) -> int:
    """Bytes this rank puts into all-gathers during one forward (FSDP's copy-in buffers)."""
    import torch.distributed as dist

    seen = []
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    orig = {n: getattr(dist, n) for n in names}

    def spy(fn):
        def wrapped(out, inp, *a, **k):
            seen.append(inp.numel() * inp.element_size())
            return fn(out, inp, *a, **k)
        return wrapped

    for n in names:
        setattr(dist, n, spy(orig[n]))
    try:
        model(x)
    finally:
        for n in names:
            setattr(dist, n, orig[n])
    return sum(seen)


def _reshard(model) -> None:
    """Back to sharded parameters everywhere (the last block keeps its unsharded ones after a forward)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def worker(tmp: str, corpus: str, hf: str) -> dict:
    import torch
    import torch.distributed as dist

    from shardlm.build import build_model, build_model_config
    from shardlm.checkpoint.manager import read_keys
    from shardlm.config import load_config
    from shardlm.distributed.env import init_distributed
    from shardlm.parallel.dims import ParallelDims
    from shardlm.quant.nf4 import GROUP, nf4_params, torchao_nf4
    from shardlm.train.trainer import Trainer

    tmp = Path(tmp)
    env = init_distributed("cpu")
    res: dict = {}
    cfg = load_config(None, qlora_overrides(tmp / "probe", corpus, hf))
    mc = build_model_config(cfg, 0)
    mesh = ParallelDims(1, -1, env.world_size).build_mesh("cpu")

    # -- the loaded NF4 model: bitwise to_nf4 of the whole weight after the all-gather -------------
    model = build_model(cfg, mc, mesh, torch.device("cpu"))
    fresh = nf4_state(model)
    from safetensors.torch import load_file

    from shardlm.interop.hf.names import our_key_to_hf

    hf_sd = {}
    for f in sorted(Path(hf).glob("*.safetensors")):
        hf_sd.update(load_file(f))
    to_nf4 = torchao_nf4().to_nf4
    bitwise, types = [], set()
    for i, block in enumerate(model.layers):
        block.unshard()
        for name, m in block.named_modules():
            if hasattr(m, "lora_A"):
                ref = to_nf4(hf_sd[our_key_to_hf(f"layers.{i}.{name}.weight")].to(torch.bfloat16))
                full = m.weight
                types.add(type(full).__name__)
                bitwise.append(all(torch.equal(getattr(full, a), getattr(ref, a)) for a in
                                   ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"))
                               and torch.equal(full.get_original_weight(), ref.get_original_weight()))
        block.reshard()
    res["bitwise"], res["gathered_types"] = bitwise, sorted(types)
    # model.init_from=dcp: (the HF folder through `convert hf-to-dcp`): the same NF4 shards, bit for bit
    dcfg = load_config(None, qlora_overrides(tmp / "probe", corpus, hf, **{"model.init_from": f"dcp:{tmp / 'dcp'}"}))
    from_dcp = build_model(dcfg, build_model_config(dcfg, 0), mesh, torch.device("cpu"))
    res["dcp_equal"] = all(all(torch.equal(a, b) for a, b in zip(v, fresh[k]))
                           for k, v in nf4_state(from_dcp).items()) and len(fresh) == 14
    del from_dcp
    nf4 = nf4_params(model)
    local_nf4 = sum(sum(getattr(p._local_tensor, a).numel() * getattr(p._local_tensor, a).element_size()
                        for a in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4"))
                    for _, _, p in nf4.values())
    local_numel = sum(p._local_tensor.numel() for _, _, p in nf4.values())
    res["nf4_bytes"], res["bf16_bytes"] = local_nf4, 2 * local_numel
    # all-gathered bytes of one forward: NF4 inputs for the base, fp32 (the policy's dtype) for the rest
    x = torch.randint(0, mc.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    other = sum(local(p).numel() * 4 for n, p in model.named_parameters() if n not in nf4)
    nf4_inputs = sum(p._local_tensor.numel() // 2 + p._local_tensor.numel() // 64 + 2 * (p._local_tensor.numel()
                     // GROUP) for _, _, p in nf4.values())
    res["gathered"] = _gathered_bytes(model, x)
    _reshard(model)
    res["gathered_expected"] = (nf4_inputs, other)

    # -- training: loss falls, NF4 base unchanged, resume exact; export ------------------------------
    def trained(name, stop_after=None, **kw):
        return (qlora_overrides(tmp / name, corpus, hf, **kw), stop_after)

    straight, first, resumed = train_then([
        trained("straight", **{"checkpoint.interval": 0}),
        trained("half", stop_after=HALF, **{"checkpoint.interval": 2, "checkpoint.async": True,
                                            "checkpoint.keep_last": 0}),  # step 2 written by async_save
        trained("half", **{"checkpoint.resume": "auto"}),
    ])
    res["straight"], res["first"], res["resumed"] = straight["loss"], first["loss"], resumed["loss"]

    t = Trainer(load_config(None, qlora_overrides(tmp / "again", corpus, hf, **{"train.steps": 3})))
    t.train()
    res["base_unchanged"] = all(all(torch.equal(a, b) for a, b in zip(v, fresh[k]))
                                for k, v in nf4_state(t.model).items())
    # our logits (sharded NF4 model, trained adapters) vs the unsharded dequantised reference
    with torch.no_grad():
        ours = t.model(x).float()
    _reshard(t.model)
    lora_sd = {n: whole(p) for n, p in t.model.named_parameters() if "lora_" in n}
    ref = nf4_reference(cfg, mc, hf, lora_sd)
    with torch.no_grad():
        res["logits_vs_reference"] = (ours - ref(x)).abs().max().item()
        from shardlm.lora import merge_lora

        merge_lora(ref)  # shardlm's merged model: W = dequant(NF4) + B A s
        merged_logits = ref(x).float()
    final = Path(t.checkpoint_dir) / "step-3"
    t.checkpointer.close()
    t.release_locks()

    a = Trainer(load_config(None, qlora_overrides(tmp / "adapters", corpus, hf, **{"train.steps": 1,
                                                                                "lora.adapters_only": True})))
    a.train()
    dist.barrier()  # rank 0 publishes the checkpoint
    res["adapters_only_keys"] = sorted(k for k in read_keys(Path(a.checkpoint_dir) / "step-1")
                                       if k.startswith("model."))
    a.checkpointer.close()
    a.release_locks()

    # random init: each rank quantises its shard of init_weights' draw, bitwise to_nf4 of the whole
    rcfg = load_config(None, [*qlora_overrides(tmp / "rand", corpus, hf), "--model.init_from="])
    rnd = build_model(rcfg, mc, mesh, torch.device("cpu"))
    layer = rnd.layers[1]
    layer.unshard()
    w = layer.mlp.down_proj.weight
    from shardlm.models import Transformer

    with torch.device("cpu"):
        plain = Transformer(mc)
    plain.init_weights(seed=rcfg.train.seed)
    ref = to_nf4(plain.layers[1].mlp.down_proj.weight.detach().to(torch.bfloat16))
    res["random_bitwise"] = torch.equal(w.quantized_data, ref.quantized_data) and \
        torch.equal(w.get_original_weight(), ref.get_original_weight())
    layer.reshard()

    # -- lora.base_dtype=bf16 against fp32 -------------------------------------------------------
    frozen = {}
    for bd in ("fp32", "bf16"):
        m = build_model(load_config(None, qlora_overrides(tmp / bd, corpus, hf, **{"lora.base_dtype": bd})), mc, mesh,
                        torch.device("cpu"))
        frozen[bd] = sum(local(p).numel() * p.dtype.itemsize for p in m.parameters() if not p.requires_grad)
        frozen[bd + "_dtypes"] = sorted({str(p.dtype) for p in m.parameters() if not p.requires_grad})
        frozen[bd + "_trained_dtypes"] = sorted({str(p.dtype) for p in m.parameters() if p.requires_grad})
    res["frozen"] = frozen
    b16, b32, b16a, b16b = train_then([
        trained("b16", **{"lora.base_dtype": "bf16", "train.steps": 4, "checkpoint.interval": 0}),
        trained("b32", **{"lora.base_dtype": "fp32", "train.steps": 4, "checkpoint.interval": 0}),
        trained("b16half", stop_after=2, **{"lora.base_dtype": "bf16", "train.steps": 4}),
        trained("b16half", **{"lora.base_dtype": "bf16", "train.steps": 4, "checkpoint.resume": "auto"})])
    res["bf16_loss"], res["fp32_loss"] = b16["loss"], b32["loss"]
    res["bf16_resumed"] = {**b16a["loss"], **b16b["loss"]}

    # -- generate / eval load the QLoRA checkpoint (both ranks: sharded), its NF4 base read dequantised ----
    from shardlm.inference import load_for_inference

    inf = load_for_inference(checkpoint=final, cfg=load_config(None, ["--train.mixed_precision=fp32",
                                                                       "--train.device=cpu"]))
    with torch.no_grad():
        res["inference_vs_merged"] = (inf.model(x).float() - merged_logits).abs().max().item()
    del inf
    # -- the merged export (rank 0; no collective) ---------------------------------------------------
    if env.rank == 0:
        import io
        from contextlib import redirect_stdout

        import transformers

        from shardlm.interop.hf.export import export_checkpoint

        buf = io.StringIO()
        with redirect_stdout(buf):
            export_checkpoint(final, tmp / "merged", merge_lora=True, dtype="fp32")
        res["export_log"] = buf.getvalue()
        hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp / "merged", dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = hf_model(x).logits.float()
        res["export_vs_merged"] = (theirs - merged_logits).abs().max().item()
        # the NF4 pieces of an async-saved checkpoint read back (dequantised) as the base trained against
        from shardlm.build import STORED_FORMS
        from shardlm.checkpoint.reader import CheckpointReader
        from shardlm.quant.nf4 import nf4_roundtrip

        reader = CheckpointReader(tmp / "half" / "checkpoints" / "step-2", STORED_FORMS)
        names = sorted(reader.encoded)
        got = reader.read(names)
        res["pieces_read_back"] = len(names) == 14 and all(
            torch.equal(got[n], nf4_roundtrip(hf_sd[our_key_to_hf(n)])) for n in names)
        res["export_vs_ours"] = (theirs - ours).abs().max().item()
    dist.barrier()
    return res


@pytest.fixture(scope="module")
def res(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("qlora")
    hf = make_hf(tmp / "hf")
    from shardlm.interop.hf.import_ import import_hf_to_dcp

    import_hf_to_dcp(hf, tmp / "dcp")
    return run_ranks(2, worker, str(tmp), str(corpus), str(hf))


def test_nf4_all_gather_is_bitwise_to_nf4_of_the_whole_weight(res):
    assert res["bitwise"] and all(res["bitwise"]) and len(res["bitwise"]) == 14
    assert res["gathered_types"] == ["NF4Tensor"]


def test_nf4_base_is_a_quarter_of_bf16_per_rank_and_travels_as_nf4(res):
    ratio = res["nf4_bytes"] / res["bf16_bytes"]
    assert 0.25 < ratio < 0.27, ratio  # 0.5 + 1/64 + 2/16384 bytes per weight (+ 34 B per tensor) vs 2
    nf4_inputs, other = res["gathered_expected"]
    assert res["gathered"] == pytest.approx(nf4_inputs + other, rel=0.01), (res["gathered"], nf4_inputs, other)


def test_sharded_nf4_logits_equal_the_dequantised_reference(res):
    assert res["logits_vs_reference"] <= 1e-6  # 0.0 here: the same dequantised weights, the same fp32 ops


def test_qlora_trains_resumes_exactly_and_keeps_its_base(res):
    loss = res["straight"]
    assert len(loss) == STEPS and loss[STEPS] < loss[1] - 0.25, loss
    assert res["first"] == {k: v for k, v in loss.items() if k <= HALF}
    assert res["resumed"] == {k: v for k, v in loss.items() if k > HALF}  # bit for bit
    assert res["base_unchanged"]


def test_adapters_only_checkpoint_holds_no_base(res):
    keys = res["adapters_only_keys"]
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), keys


def test_random_init_quantises_per_shard_bitwise(res):
    assert res["random_bitwise"]


def test_checkpoints_hold_the_nf4_pieces_and_read_back_dequantised(res):
    assert res["pieces_read_back"]


def test_generate_loads_a_qlora_checkpoint_merged(res):
    """load_for_inference (shardlm generate / eval) of a QLoRA checkpoint: the dequantised NF4 base + B A s."""
    assert res["inference_vs_merged"] <= 1e-5, res["inference_vs_merged"]


def test_merged_export_loads_in_transformers_and_matches(res):
    assert "NF4-quantised base" in res["export_log"]
    assert res["export_vs_merged"] <= 1e-5, res["export_vs_merged"]  # transformers = shardlm on the merged weights
    # and the unmerged sharded NF4 model: (W + B A s) x against W x + B (A x) s, fp32 rounding apart (|logits| ~14)
    assert res["export_vs_ours"] <= 5e-4, res["export_vs_ours"]


def test_bf16_base_halves_frozen_bytes_and_matches_fp32_losses(res):
    f = res["frozen"]
    assert f["bf16"] * 2 == f["fp32"]
    assert f["bf16_dtypes"] == ["torch.bfloat16"] and f["fp32_dtypes"] == ["torch.float32"]
    assert f["bf16_trained_dtypes"] == ["torch.float32"]  # adapters keep fp32 master weights
    for step, l32 in res["fp32_loss"].items():
        assert res["bf16_loss"][step] == pytest.approx(l32, rel=2e-3)  # the base rounded to bf16 only
    assert res["bf16_loss"] != res["fp32_loss"]  # (it did change: the bf16 base is in use)
    assert res["bf16_resumed"] == res["bf16_loss"]  # save at 2 + resume = straight, bit for bit


def test_init_from_dcp_quantises_the_same(res):
    assert res["dcp_equal"]
