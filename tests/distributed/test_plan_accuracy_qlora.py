"""The planner against reality for QLoRA (lora.base_dtype=nf4) and the bf16 frozen base: within 15%.

Same method as test_plan_accuracy (its `real_worker`: the trainer's build with real tensors on 2 gloo
ranks, AdamW, one tracked training step): the real side quantises each rank's shards of the random init
to NF4 (`shardlm.quant.nf4`), the planner's fake build puts fake NF4 shards of torchao's sizes in their
place (FakeTensorMode cannot run the quantiser: `assign_empty`), so both see NF4 sharded parameters,
NF4 all-gather buffers and the per-matmul dequantised weights.

Seen here (torch 2.13, torchao 0.18, 2 gloo ranks, fp32 compute, micro-batch 1 x 64): planned vs real peak
per rank 29,253,924 vs 29,253,428 B (nf4), 47,253,492 vs 47,252,996 B (bf16 base), 54,071,796 vs
54,071,300 B (fp32 base): 496 B apart each time.
"""

from __future__ import annotations

import pytest
from helpers.launch import run_ranks
from helpers.plan_accuracy import TOL, plan_config, real_worker

pytest.importorskip("torchao")

# dim 512 (every linear splits into whole NF4 groups on 2 ranks), 2 layers, ~4.7M parameters
SHAPE = ["--model.preset=debug", "--model.dim=512", "--model.n_layers=2", "--model.n_heads=8", "--model.n_kv_heads=4",
         "--model.ffn_dim=1024", "--model.vocab_size=2048", "--train.mixed_precision=fp32",
         "--train.micro_batch_size=1", "--data.seq_len=64", "--lora.rank=8"]
CASES = {"qlora_nf4": ([*SHAPE, "--lora.base_dtype=nf4"], "none"),
         "lora_bf16_base": ([*SHAPE, "--lora.base_dtype=bf16"], "none"),
         "lora_fp32_base": ([*SHAPE, "--lora.base_dtype=fp32"], "none")}


@pytest.fixture(scope="module")
def real():
    return run_ranks(2, real_worker, CASES)


def test_qlora_planned_within_15_percent_of_real(real):
    from shardlm.plan import plan

    seen = {}
    for name, (overrides, ac) in CASES.items():
        report = plan(plan_config(overrides, ac), world_size=2, gpu_mem_gib=80, gpus_per_node=2, alternatives=False)
        planned, measured = report.base.peak.total, real[name]["peak"]
        seen[name] = (planned, measured)
        rel = abs(planned - measured) / measured
        assert rel <= TOL, (f"{name}: planned {planned} B vs real {measured} B ({rel:.1%})\n"
                            f"planned split {report.base.peak.raw}\nreal split {real[name]['split']}")
    # the base shrinks in the plan as it does for real: fp32 > bf16 > nf4 on both sides
    assert seen["lora_fp32_base"][0] > seen["lora_bf16_base"][0] > seen["qlora_nf4"][0], seen
    assert seen["lora_fp32_base"][1] > seen["lora_bf16_base"][1] > seen["qlora_nf4"][1], seen
