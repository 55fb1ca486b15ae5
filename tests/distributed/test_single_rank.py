"""One rank (a laptop, one GPU): FSDP over a mesh of one leaves alone the parameters whose "all-gather" would
only copy the one shard into a second buffer (`parallel.fsdp.single_copy_params`), and QLoRA runs there.

One spawn of 1 gloo rank on the tiny HF llama of test_qlora_fsdp (dim 256, 2 layers), seq 64:
  * LoRA on a bf16 base, bf16 compute, measured by the tracker in real mode around one training step (the
    accuracy test's `real_worker`), once as built now and once with every parameter under FSDP (as before):
    the frozen base is plain tensors, the peak's "Unsharded Param" loses the frozen root and block copies, the
    peak total drops by at least that, and the losses of the step are identical;
  * QLoRA (lora.base_dtype=nf4) trains on 1 rank (it crashed in torch's one-rank all-gather path before): its
    losses equal those of the same global batch on 2 ranks (a second spawn, where FSDP shards the NF4 base) and
    fall, the NF4 base stays bitwise the same, the logits equal the dequantised reference model's;
  * the planner on 1 rank agrees with the real step (the accuracy test's tolerance) for both.

Seen here (torch 2.13): LoRA on a bf16 base, the step's peak 5.01 -> 3.95 MiB, its unsharded parameters
1.115 -> 0.051 MiB (the adapters' bf16 copies); QLoRA's logits equal the reference's (0.0).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.launch import run_ranks
from helpers.plan_accuracy import TOL, plan_config, real_worker
from helpers.qlora import make_hf, nf4_reference, qlora_overrides
from helpers.whole import whole

pytest.importorskip("transformers")
pytest.importorskip("torchao")

STEPS = 8  # as test_qlora_fsdp's straight run
LORA = ["--lora.rank=8", "--lora.alpha=16", "--train.micro_batch_size=2", "--data.seq_len=64"]


def _cases(hf: str) -> dict:
    base = [f"--model.init_from=hf:{hf}", f"--data.tokenizer={hf}/tokenizer.json", *LORA]
    return {"lora_bf16": ([*base, "--lora.base_dtype=bf16", "--train.mixed_precision=bf16"], "full"),
            "qlora": ([*base, "--lora.base_dtype=nf4", "--train.mixed_precision=fp32"], "none")}


def _nf4_pieces(model) -> dict:
    from shardlm.quant.nf4 import nf4_params

    return {n: [getattr(p, a).clone() for a in ("quantized_data", "quantized_scalers", "quantization_factor")]
            for n, (_, _, p) in nf4_params(model).items()}


def _qlora(tmp: str, corpus: str, hf: str, world: int) -> list[str]:
    """QLoRA for STEPS steps, the same global batch of 4 sequences on `world` ranks."""
    return qlora_overrides(Path(tmp) / f"qlora{world}", corpus, hf, **{"train.micro_batch_size": 4 // world,
                                                                        "checkpoint.interval": 0})


def two_ranks(tmp: str, corpus: str, hf: str) -> list[float]:
    from shardlm.config import load_config
    from shardlm.train.trainer import Trainer

    t = Trainer(load_config(None, _qlora(tmp, corpus, hf, 2)))
    loss = [r["loss"] for r in t.train()]
    t.checkpointer.close()
    t.release_locks()
    return loss


def worker(tmp: str, corpus: str, hf: str) -> dict:
    import torch

    from shardlm.config import load_config
    from shardlm.distributed.env import init_distributed
    from shardlm.parallel import fsdp
    from shardlm.train.trainer import Trainer

    env = init_distributed("cpu")
    assert env.world_size == 1
    res = {"real": real_worker(_cases(hf))}
    keep = fsdp.single_copy_params
    fsdp.single_copy_params = lambda *a, **k: set()  # every parameter under FSDP, as before
    try:
        res["all_fsdp"] = real_worker({"lora_bf16": _cases(hf)["lora_bf16"]})
    finally:
        fsdp.single_copy_params = keep

    # -- QLoRA on one process: the trainer, as `shardlm train` without torchrun runs it --------------------
    t = Trainer(load_config(None, _qlora(tmp, corpus, hf, 1)))
    res["plain"] = sorted({type(p).__name__ for p in t.model.parameters() if not p.requires_grad})
    res["adapters"] = sorted({type(p).__name__ for p in t.model.parameters() if p.requires_grad})
    before = _nf4_pieces(t.model)
    res["loss"] = [r["loss"] for r in t.train()]
    res["base_unchanged"] = len(before) == 14 and all(
        all(torch.equal(a, b) for a, b in zip(v, before[k])) for k, v in _nf4_pieces(t.model).items())
    x = torch.randint(0, t.model_cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = t.model(x).float()
    lora_sd = {n: whole(p) for n, p in t.model.named_parameters()
               if "lora_" in n}
    ref = nf4_reference(t.cfg, t.model_cfg, hf, lora_sd)
    with torch.no_grad():
        res["logits_vs_reference"] = (ours - ref(x)).abs().max().item()
    t.checkpointer.close()
    t.release_locks()
    return res


@pytest.fixture(scope="module")
def res(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("one")
    hf = make_hf(tmp / "hf")
    out = run_ranks(1, worker, str(tmp), str(corpus), str(hf))
    out["hf"], out["two_ranks"] = str(hf), run_ranks(2, two_ranks, str(tmp), str(corpus), str(hf))
    return out


def test_one_rank_keeps_no_second_copy_of_the_frozen_base(res):
    now, was = res["real"]["lora_bf16"], res["all_fsdp"]["lora_bf16"]
    unsharded_now, unsharded_was = now["split"].get("Unsharded Param", 0), was["split"].get("Unsharded Param", 0)
    # before: the frozen bf16 root (embeddings + head) and a block were copied whole beside their only shard
    assert unsharded_was > 10 * max(unsharded_now, 1), (unsharded_now, unsharded_was)
    assert was["peak"] - now["peak"] >= unsharded_was - unsharded_now, (now["peak"], was["peak"])


def test_qlora_trains_on_one_process(res):
    assert res["plain"] == ["NF4Tensor", "Parameter"]  # the frozen base: left to the module, NF4 and bf16/fp32
    assert res["adapters"] == ["Parameter"]  # fp32 compute: nothing to cast, so FSDP manages nothing on one rank
    loss, two = res["loss"], res["two_ranks"]
    assert len(loss) == len(two) == STEPS and loss[-1] < loss[0] - 0.25, loss
    assert loss == pytest.approx(two, rel=1e-5), (loss, two)
    assert res["base_unchanged"]
    assert res["logits_vs_reference"] < 1e-4, res["logits_vs_reference"]


@pytest.mark.parametrize("case", ["lora_bf16", "qlora"])
def test_planner_on_one_rank_matches_the_real_step(res, case):
    from shardlm.plan import plan

    overrides, ac = _cases(res["hf"])[case]
    report = plan(plan_config(overrides, ac), world_size=1, gpu_mem_gib=80, gpus_per_node=1, alternatives=False)
    planned, measured = report.base.peak.total, res["real"][case]["peak"]
    assert abs(planned - measured) / measured <= TOL, (planned, measured, report.base.peak.raw,
                                                       res["real"][case]["split"])
