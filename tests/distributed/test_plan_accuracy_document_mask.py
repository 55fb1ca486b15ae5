"""The planner against reality with document masks (data.document_mask): planned within 15% of a real run.

One spawn of 2 gloo ranks measures the same training step with and without document masks, by
test_plan_accuracy's own worker (`real_worker`: the trainer's build, AdamW, `forward_backward`, clip, under
FSDPMemTracker in real mode); for the masked case its micro-batches get positions, as the trainer's loader
gives them (a document every 256 tokens), so the model builds the dense (B, 1, T, T) mask and runs SDPA
with it (sdpa-mask: what a CPU runs). The plans are made with document_attention="sdpa-mask" in this process.
Flex attention (CUDA) cannot run here; tests/unit/test_plan_document_mask.py checks its stand-ins' shapes.

Seen here (torch 2.13, micro-batch 2 x 512, fp32): planned and real agree to 8 bytes, 57,896,940 vs
57,896,948 B without masks and 66,555,884 vs 66,555,892 B with them (+8,658,944 B: an fp32 (2, 1, 512, 512)
mask per layer, 4 layers, + per-token cos/sin + positions).
"""

from __future__ import annotations

import pytest
from helpers.launch import run_ranks
from helpers.plan_accuracy import TOL, plan_config, real_worker

BASE = ["--model.preset=debug", "--train.mixed_precision=fp32", "--train.micro_batch_size=2", "--data.seq_len=512"]
CASES = {"causal": (BASE, "none"), "documents": ([*BASE, "--data.document_mask=true"], "none")}


def _worker(cases: dict) -> dict:
    import shardlm.train.step as step
    from shardlm.plan.attention import positions

    plain = {k: v for k, v in cases.items() if "--data.document_mask=true" not in v[0]}
    out = real_worker(plain)
    forward_backward = step.forward_backward

    def with_positions(model, batches, *args, **kwargs):  # (inputs, labels) -> (inputs, labels, positions)
        return forward_backward(model, [(x, y, positions(*x.shape, x.device)) for x, y in batches], *args, **kwargs)

    step.forward_backward = with_positions  # `real_worker` imports it when it runs
    try:
        out.update(real_worker({k: v for k, v in cases.items() if k not in plain}))
    finally:
        step.forward_backward = forward_backward
    return out


@pytest.fixture(scope="module")
def real():
    return run_ranks(2, _worker, CASES)


def test_document_masks_planned_within_15_percent_of_real(real):
    from shardlm.plan import plan

    planned = {}
    for name, (overrides, ac) in CASES.items():
        report = plan(plan_config(overrides, ac), world_size=2, gpu_mem_gib=80, gpus_per_node=2, alternatives=False,
                      document_attention="sdpa-mask")
        planned[name] = report.base.peak.total
        measured = real[name]["peak"]
        rel = abs(planned[name] - measured) / measured
        assert rel <= TOL, (f"{name}: planned {planned[name]} B vs real {measured} B ({rel:.1%})\n"
                            f"planned split {report.base.peak.raw}\nreal split {real[name]['split']}")
    # the masks cost what the planner says they cost: the extra bytes agree too
    extra_planned = planned["documents"] - planned["causal"]
    extra_real = real["documents"]["peak"] - real["causal"]["peak"]
    assert extra_real > 0 and extra_planned == pytest.approx(extra_real, rel=TOL)
