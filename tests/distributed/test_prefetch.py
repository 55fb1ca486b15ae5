"""FSDP2 schedule knobs on 2 gloo ranks (one spawn for the module): parallel.prefetch only reorders the
all-gathers and parallel.reshard_after_forward only changes which blocks are gathered again in backward,
so three optimizer steps give bit-identical losses and weights for every setting; and each setting does
what it says (all-gathers issued per block, blocks still unsharded after forward; the norm + head unit is
gathered once per step, the embedding again for its backward). reshard_after_forward=auto settles after a step has run (as a run does after
step 2 on GPUs, from the memory left free at the peak, here stood in for) and takes effect from the next forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.launch import run_ranks
from helpers.whole import whole

L = 4  # blocks
CASES = {  # name: apply_fsdp keyword arguments
    "prefetch1": {},
    "prefetch2": {"prefetch": 2},
    "prefetch3": {"prefetch": 3},
    "reshard_true": {"reshard_after_forward": True},
    "reshard_false": {"reshard_after_forward": False},
    "reshard_2": {"reshard_after_forward": 2, "prefetch": 2},
    "auto_cpu": {"reshard_after_forward": "auto"},  # no accelerator: the last block only
    "auto_free": {"reshard_after_forward": "auto", "spare_bytes": 2**40},  # plenty of memory: every block
    "auto_late": {"reshard_after_forward": "auto", "late": 1.5},  # 1 block; after a step room for 1.5 blocks more
}


def _build(mesh, late=0, **kwargs):  # late: see _worker
    from shardlm.models.llama import ModelConfig, Transformer
    from shardlm.parallel.fsdp import apply_fsdp, mp_policy, shard_view

    cfg = ModelConfig(dim=32, n_layers=L, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=64, max_seq_len=32)
    with torch.device("meta"):
        m = Transformer(cfg)
    apply_fsdp(m, mesh, mp_policy("fp32", "fp32"), **kwargs)
    m.to_empty(device="cpu")
    m.init_weights(seed=0, shard_view=shard_view)
    return m


def _worker() -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from shardlm.distributed.env import init_distributed
    from shardlm.parallel.dims import ParallelDims
    from shardlm.parallel import fsdp
    from shardlm.parallel.fsdp import clip_grad_norm_
    from shardlm.train.step import forward_backward

    env = init_distributed("cpu")
    mesh = ParallelDims(1, -1, env.world_size).build_mesh("cpu")
    spare = fsdp.spare_device_bytes
    assert spare(mesh, cpu_offload=False) is None  # CPU: nothing to decide
    events: list[str] = []
    depth = [0]

    def counted(real):
        def call(*a, **k):
            if depth[0] == 0:  # an older name may call a newer one: count the outer call only
                events.append("ag")
            depth[0] += 1
            try:
                return real(*a, **k)
            finally:
                depth[0] -= 1
        return call

    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]  # torch 2.13 / older
    real = {n: getattr(dist, n) for n in names}
    for n in names:
        setattr(dist, n, counted(real[n]))
    g = torch.Generator().manual_seed(env.rank)
    data = [[(x, x.roll(-1, 1)) for x in torch.randint(0, 97, (2, 2, 16), generator=g)] for _ in range(3)]
    out = {}
    for name, kwargs in CASES.items():
        m = _build(mesh, **kwargs)
        if kwargs.get("late"):  # a forward and backward with k = 1 first (no update), then settle
            forward_backward(m, data[0], 1.0 / 64, env.device)
            m.zero_grad(set_to_none=True)
            assert not m.fsdp_choices.pending_auto  # on CPU nothing is left to decide; here as on a GPU:
            m.fsdp_choices = dataclasses.replace(m.fsdp_choices, pending_auto=True)
            fsdp.spare_device_bytes = lambda *a, **k: int(kwargs["late"] * m.fsdp_choices.block_bytes)
            try:
                settled = fsdp.settle_auto_reshard(m, mesh, cpu_offload=False)
            finally:
                fsdp.spare_device_bytes = spare
            assert settled.startswith("parallel.reshard_after_forward=auto after step 2: 2 of 4 blocks"), settled
            assert fsdp.settle_auto_reshard(m, mesh, cpu_offload=False) is None  # once
        for i, block in enumerate(m.layers):  # runs before FSDP's own pre-forward hook (it is prepended too)
            block.register_forward_pre_hook(lambda mod, args, i=i: events.append(f"fwd{i}"), prepend=True)
        m.norm.register_forward_pre_hook(lambda mod, args: events.append("head"), prepend=True)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for step, batches in enumerate(data):
            events.clear()
            if step == 0:  # one forward alone: which blocks kept their unsharded parameters?
                loss = m(batches[0][0], labels=batches[0][1])
                kept = [not isinstance(b.self_attn.q_proj.weight, DTensor) for b in m.layers]
                fwd_events = list(events)
                events.clear()
                loss.backward()
                bwd_gathers = events.count("ag")
                m.zero_grad(set_to_none=True)
                events.clear()
            loss_sum = forward_backward(m, batches, 1.0 / 64, env.device)
            clip_grad_norm_([p for p in m.parameters()], 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            dist.all_reduce(loss_sum)
            losses.append(loss_sum.item())
        weights = {n: whole(p).clone() for n, p in m.named_parameters()}
        out[name] = {"losses": losses, "weights": weights, "kept": kept, "fwd_events": fwd_events,
                     "bwd_gathers": bwd_gathers, "choices": m.fsdp_choices}
        del m, opt
    for n in names:
        setattr(dist, n, real[n])
    out["held"] = {how: _held_in_block_backward(mesh, data[0][:1], how) for how in ("units", "old_root")}
    return out


def _held_in_block_backward(mesh, batches, how: str) -> dict:
    """Unsharded parameter bytes (the tracker in real mode) while block 1 runs backward: with shardlm's units
    (apply_fsdp), and with the wrapping before them (blocks, then a root passed reshard_after_forward=True,
    which torch honours: the root is freed after forward and gathered again for the whole backward)."""
    from torch.distributed.fsdp import fully_shard

    from shardlm.models.llama import ModelConfig, Transformer
    from shardlm.parallel.fsdp import mp_policy, shard_view
    from shardlm.plan.tracker import PlanTracker
    from shardlm.train.step import forward_backward

    if how == "units":
        m = _build(mesh)
    else:
        cfg = ModelConfig(dim=32, n_layers=L, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=64, max_seq_len=32)
        with torch.device("meta"):
            m = Transformer(cfg)
        for i, block in enumerate(m.layers):
            fully_shard(block, mesh=mesh, mp_policy=mp_policy("fp32", "fp32"), reshard_after_forward=i < L - 1)
        fully_shard(m, mesh=mesh, mp_policy=mp_policy("fp32", "fp32"), reshard_after_forward=True)
        m.to_empty(device="cpu")
        m.init_weights(seed=0, shard_view=shard_view)
    tracker = PlanTracker(m)
    tracker.phases = {}
    with tracker:
        forward_backward(m, batches, 1.0 / 64, torch.device("cpu"))
    snap = next(s for (phase, bw, blocks, _), (_, s, _) in tracker.phases.items() if bw and blocks == (1,))
    held = sum(v for d in snap.values() for k, v in d.items() if str(getattr(k, "value", k)) == "Unsharded Param")
    root = sum(p.numel() * 4 for p in (m.embed_tokens.weight, m.lm_head.weight))  # fp32: the vocab x dim pair
    return {"held": held, "root": root}


@pytest.fixture(scope="module")
def results():
    return run_ranks(2, _worker)


def _gathers_per_block(events: list[str]) -> list[int]:
    """All-gathers issued from each block's pre-forward (the embedding's come before block 0's marker, the final
    norm + head's after the "head" marker)."""
    marks = [i for i, e in enumerate(events) if e.startswith("fwd")]
    end = events.index("head")
    return [events[a + 1:b].count("ag") for a, b in zip(marks, marks[1:] + [end])]


@pytest.mark.parametrize("name", [n for n in CASES if n != "prefetch1"])
def test_same_losses_and_weights_as_the_default(results, name):
    want, got = results["prefetch1"], results[name]
    assert got["losses"] == want["losses"], name  # bit-identical: only the order of all-gathers differs
    assert len(set(want["losses"])) == 3  # the weights moved: three different losses
    for n, w in want["weights"].items():
        assert torch.equal(got["weights"][n], w), f"{name}: {n}"


def test_prefetch_issues_the_next_blocks_all_gathers_early(results):
    assert _gathers_per_block(results["prefetch1"]["fwd_events"]) == [1] * L  # implicit: each block its own
    for n in (2, 3):
        per_block = _gathers_per_block(results[f"prefetch{n}"]["fwd_events"])
        assert per_block[0] == 1 + n and sum(per_block) == L, (n, per_block)  # block 0 gathers itself + n ahead
        assert results[f"prefetch{n}"]["choices"].prefetch == n


@pytest.mark.parametrize("name, k", [("prefetch1", 1), ("reshard_true", 1), ("reshard_false", L), ("reshard_2", 2),
                                     ("auto_cpu", 1), ("auto_free", L), ("auto_late", 2)])
def test_reshard_after_forward_keeps_the_last_k_blocks(results, name, k):
    r = results[name]
    assert r["kept"] == [i >= L - k for i in range(L)], (name, r["kept"])
    # backward gathers the resharded blocks and the embedding (its own unit), never the norm + head (kept)
    assert r["bwd_gathers"] == L - k + (name != "reshard_false"), name
    assert r["fwd_events"][0] == "ag" and r["fwd_events"][r["fwd_events"].index("head") + 1] == "ag"
    assert r["choices"].unsharded == k and r["choices"].n_blocks == L and not r["choices"].pending_auto
    assert ("auto" in r["choices"].reshard_reason) == name.startswith("auto")


def test_embedding_and_head_are_not_held_through_the_blocks_backward(results):
    """Measured by the tracker (real mode, 2 gloo ranks) while a middle block runs backward: the wrapping before
    (the root resharded after forward, gathered again at the start of backward and held to its end) holds the
    unsharded embedding and head there; shardlm's units hold neither (2 x vocab x dim less)."""
    units, old = results["held"]["units"], results["held"]["old_root"]
    assert old["held"] - units["held"] >= units["root"] > 0, (units, old)
