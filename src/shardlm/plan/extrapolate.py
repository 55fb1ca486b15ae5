"""Plan a deep model from two short fake steps (see the comment below): same bytes, a fraction of the time."""

from __future__ import annotations

import math

from shardlm.config import Config
from shardlm.models.llama import ModelConfig
from shardlm.plan.allocator import LARGE_PAGE
from shardlm.plan.fake_step import StepMemory

# -- fewer layers, same answer ---------------------------------------------------------------------
#
# Every transformer block is the same module with the same shapes, so the memory of a step is, at
# every moment, affine in the number of layers L: each block adds its sharded params, grads and
# AdamW moments for the whole step, and, between its forward and its backward, its saved
# activations. A step is a sequence of phases (forward of block k, backward of block k, the loss,
# the clip, the optimizer step; per micro-batch). The planner records each phase's own peak (and
# the composition at it). For the phases outside the blocks, and for the first and last EDGE
# blocks (FSDP's prefetch and the unresharded last block make those differ), the peak is affine in
# L; for a middle block k it is affine in (k, L), so over the middle blocks its maximum is at the
# first or the last one. Two fake steps with L_a and L_a + p layers (p: the period of
# train.ac=selective's every-n-th pattern, else 1) fix every line; the plan for L layers is the
# maximum over the phases of their lines at L. Every point of both runs is checked against the
# fit (to the byte in practice); if any is off, or the phases of the two runs differ, the planner
# runs all L layers instead. tests/unit/plan/test_plan.py compares this with all-layer runs.

_EDGE = 2
MIN_SAVING = 12  # blocks: see `reduced_layers` (tests lower it to extrapolate small models)


def period_of(cfg: Config, mc: ModelConfig | None = None) -> int | None:
    """Layers after which the block pattern repeats: train.ac_every under selective AC, else 1; a mixture of
    experts with a sparse block every `moe_layer_step` blocks repeats at their least common multiple, and one
    with dense blocks at given indices (mlp_only_layers) not at all: None (plan every layer)."""
    period = cfg.train.ac_every if cfg.train.ac == "selective" else 1
    if mc is not None and mc.n_experts:
        if mc.dense_layers:
            return None
        period = math.lcm(period, mc.moe_layer_step)
    return period


def reduced_layers(n_layers: int, period: int) -> tuple[int, int] | None:
    """The two layer counts to run instead of `n_layers`, or None when running all is as cheap."""
    n0 = 2 * _EDGE + 4 + 2 * period  # >= 2 middle blocks per residue fix its line; the others check it
    n_a = n0 + (n_layers - n0) % period  # same residue as n_layers: same edge pattern
    n_b = n_a + period
    # A fake step costs a fixed part (build, to_empty, optimizer, embedding and head: about what 10
    # blocks cost) plus its blocks: two short steps win once the model is deeper than ~n_a + n_b + 12.
    return (n_a, n_b) if n_layers > max(n_b + period, n_a + n_b + MIN_SAVING) else None


def _classify(blocks: tuple[int, ...], n: int, period: int):
    """A phase's block (none, or one: see `_phase_key`) -> (class, middle index or None).

    Outside the blocks and in an edge block the class names the block by its index from its nearer
    end; a middle block `m` is classed by its residue mod the period and returned as the index."""
    if not blocks or not _EDGE <= blocks[0] < n - _EDGE:
        return ("edge", tuple(k if k < n - k else k - n for k in blocks)), None
    return ("mid", blocks[0] % period), blocks[0]


class NotAffine(Exception):
    pass


def lerp(a: dict[str, int], b: dict[str, int], t: float) -> dict[str, float]:
    keys = set(a) | set(b)
    return {k: a.get(k, 0) + (b.get(k, 0) - a.get(k, 0)) * t for k in keys}


def _close(pred: dict[str, float], actual: dict[str, int]) -> bool:
    tol = max(4096.0, 1e-4 * actual.get("Total", 0))
    return all(abs(pred.get(k, 0) - actual.get(k, 0)) <= tol for k in set(pred) | set(actual))


def extrapolate_peak(a: StepMemory, b: StepMemory, n_layers: int, period: int) -> tuple[dict[str, int], int]:
    """The peak snapshot (and the CPU-offload peak) of an `n_layers` step from two shorter ones."""
    groups: dict[tuple, dict[int, list]] = {}
    for run in (a, b):
        for (phase, bw, blocks, other), flat in run.phases.items():
            cls, m = _classify(blocks, run.n_layers, period)
            groups.setdefault((phase, bw, cls, other), {}).setdefault(run.n_layers, []).append((m, flat))
    t = (n_layers - a.n_layers) / (b.n_layers - a.n_layers)
    preds: list[dict[str, float]] = []
    for key, by_run in groups.items():
        if set(by_run) != {a.n_layers, b.n_layers}:
            raise NotAffine(f"phase {key} is not in both runs")
        pa, pb = by_run[a.n_layers], by_run[b.n_layers]
        if key[2][0] == "edge":
            preds.append(lerp(pa[0][1], pb[0][1], t))
            continue
        pa, pb = sorted(pa, key=lambda x: x[0]), sorted(pb, key=lambda x: x[0])
        (m1, f1), (m2, f2) = pa[0], pa[-1]
        if m1 == m2:
            raise NotAffine(f"phase {key}: one middle block only")
        fb = dict(pb)
        if m1 not in fb:
            raise NotAffine(f"phase {key}: block {m1} missing in the longer run")

        def at(m: int, n: int, f1=f1, f2=f2, m1=m1, m2=m2, g=fb[m1]) -> dict[str, float]:
            along_k = lerp(f1, f2, (m - m1) / (m2 - m1))  # same run, another middle block
            # plus what the same block gains per `period` more layers (g: block m1 in the longer run)
            return {k: along_k.get(k, 0) + (g.get(k, 0) - f1.get(k, 0)) * (n - a.n_layers) / period
                    for k in set(along_k) | set(g)}

        for run, pts in ((a, pa), (b, pb)):  # every measured point must lie on the fit
            for m, f in pts:
                if not _close(at(m, run.n_layers), f):
                    raise NotAffine(f"phase {key}: block {m} of {run.n_layers} is off the fit")
        r = key[2][1]
        lo = _EDGE + (r - _EDGE) % period
        hi = (n_layers - _EDGE - 1) - (n_layers - _EDGE - 1 - r) % period
        preds += [at(lo, n_layers), at(hi, n_layers)]
    for run in (a, b):  # the phases cover the step: their maximum is the run's peak
        if max(f["Total"] for f in run.phases.values()) != run.peak["Total"]:
            raise NotAffine("the phase peaks miss the step's peak")
    best = max(preds, key=lambda f: f.get("Total", 0))
    peak = {k: max(0, round(v)) for k, v in best.items() if k != "offload"}
    offload = max(0, round(max(f.get("offload", 0) for f in preds)))
    return peak, offload


# -- the allocator's segments ------------------------------------------------------------------------
#
# The replayed caching allocator (`plan.allocator`) maps a segment per stream, and a segment never shrinks: the
# reserved peak is the sum of their final sizes. The compute and reduce-scatter segments grow by the same bytes
# per block (activations; the sharded gradients), up to the allocator's 20 MiB pages: affine in L. The
# all-gather segment holds a few blocks' buffers in flight, whose pattern repeats every 2 blocks (FSDP's
# implicit prefetch pairs them: with an odd L it holds one more, seen on Llama-3-8B and 70B): it is taken from
# the shorter run of L's parity, which `reduced_layers` always includes.
#
# A segment can also jump once: a request that no longer fits a hole maps new pages at one depth and not at the
# next (Mixtral-8x22B on 64 ranks: the compute segment grows 1.07 GiB from 10 to 11 blocks, then 0.28 and 0.41 per
# block, where the tensors grow 0.58). Extrapolated, a jump is multiplied by the blocks left (there: 96 GiB reserved
# planned, 68 when every block is replayed). A segment that grows more than the tensors do, plus a page, between
# the two runs is therefore not taken as a per-block growth: NotAffine, and every block is planned.


def extrapolate_segments(sa: dict[str, int], sb: dict[str, int], a: StepMemory, b: StepMemory,
                         n_layers: int) -> dict[str, int]:
    """Each segment's bytes for `n_layers` from the two shorter runs `a` and `b` (see above)."""
    t = (n_layers - a.n_layers) / (b.n_layers - a.n_layers)
    tensors = max(0, b.peak.get("Total", 0) - a.peak.get("Total", 0))
    out = {}
    for k in set(sa) | set(sb):
        if k.startswith("all-gather/"):
            same = [seg for run, seg in ((a, sa), (b, sb)) if (n_layers - run.n_layers) % 2 == 0]
            out[k] = same[0].get(k, 0) if same else max(sa.get(k, 0), sb.get(k, 0))
            continue
        grew = sb.get(k, 0) - sa.get(k, 0)
        if grew > tensors + LARGE_PAGE:
            raise NotAffine(f"the allocator's {k} segment grew {grew / 2**30:.2f} GiB from {a.n_layers} to "
                            f"{b.n_layers} layers, the tensors {tensors / 2**30:.2f} GiB: a jump, not a per-layer growth")
        out[k] = max(0, round(sa.get(k, 0) + grew * t))
    return out
