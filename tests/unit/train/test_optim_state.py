"""train.optimizer_state_dtype in one process: the update, what each dtype stores, training quality, errors.

The 50-step comparison trains a small Llama (the debug preset at dim 64, 2 layers: 0.13M parameters; seq 64,
4 sequences a step from a noisy Markov chain, the trainer's warmup + cosine schedule at lr 3e-3) three times
from the same weights and data.
Seen here (torch 2.13, torchao 0.18; loss 5.55 -> 3.24): the largest |loss - fp32's loss| / fp32's loss over the
50 steps was 3.0e-5 for bf16 (7e-6 at the end) and 9.4e-3 for int8 (8.4e-3 at the end). The tolerances (bf16:
1e-3 at any step and at the end; int8: 3% at any step, 2.5% at the end) leave ~3x room for other builds but not
for a broken update (a moment stored wrong or an LR ignored moves the curve by tens of percent).
The distributed checks (1/2/4 shards, resume, reshard, bytes per rank) are in tests/distributed/test_optim_state_fsdp.py.
"""

from __future__ import annotations

import io
import sys

import pytest
import torch

from shardlm.config import load_config
from shardlm.errors import ConfigError
from shardlm.train.optim import (
    AdamWBF16State,
    AdamWInt8State,
    LowPrecisionStateAdamW,
    build_lr_scheduler,
    build_optimizer,
    check_int8_shards,
    int8_quantised,
    state_bytes,
)

CPU = torch.device("cpu")
SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=256)  # 0.13M parameters


def _train(dtype: str, steps: int = 50) -> tuple[list[float], torch.optim.Optimizer]:
    import dataclasses

    from shardlm.models import Transformer, get_preset

    cfg = load_config(None, ["--model.preset=debug", f"--train.optimizer_state_dtype={dtype}", "--train.lr=3e-3",
                             f"--train.steps={steps}", "--train.warmup_steps=5"])
    torch.manual_seed(0)
    mc = dataclasses.replace(get_preset("debug"), **SMALL)
    model = Transformer(mc)
    model.init_weights()
    opt = build_optimizer(model, cfg.train, CPU)
    sched = build_lr_scheduler(opt, cfg.train)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        # a noisy Markov chain: the next token is 7 x this one + 1 (mod vocab) 3 times in 4
        x = torch.empty(4, 65, dtype=torch.long)
        x[:, 0] = torch.randint(0, mc.vocab_size, (4,), generator=gen)
        for i in range(64):
            noise = torch.randint(0, mc.vocab_size, (4,), generator=gen)
            keep = torch.rand(4, generator=gen) < 0.75
            x[:, i + 1] = torch.where(keep, (7 * x[:, i] + 1) % mc.vocab_size, noise)
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
    return losses, opt


@pytest.fixture(scope="module")
def runs():
    return {d: _train(d) for d in ("fp32", "bf16", "int8")}


@pytest.mark.parametrize("dtype,any_step,final", [("bf16", 1e-3, 1e-3), ("int8", 0.03, 0.025)])
def test_losses_track_fp32_state_over_50_steps(runs, dtype, any_step, final):
    ref, got = runs["fp32"][0], runs[dtype][0]
    assert ref[-1] < 0.7 * ref[0]  # it learned something: the comparison means something
    rel = [abs(a - b) / b for a, b in zip(got, ref)]
    assert max(rel) < any_step, (dtype, max(rel), rel.index(max(rel)))
    assert rel[-1] < final, (dtype, got[-1], ref[-1])
    assert got != ref  # the state really was stored at lower precision


def test_state_classes_and_bytes(runs):
    """bf16: exactly half of fp32's moment bytes; int8: a code per value + a scale per 256 + a 1 KB code
    table per 8-bit tensor; tensors under 4096 values (norm weights) keep fp32 moments, as in torchao."""
    opts = {d: runs[d][1] for d in runs}
    assert [type(opts[d]).__name__ for d in ("fp32", "bf16", "int8")] == ["AdamW", "AdamWBF16State",
                                                                          "AdamWInt8State"]
    params = [p for g in opts["fp32"].param_groups for p in g["params"]]
    steps = 4 * len(params)
    assert state_bytes(opts["fp32"]) == steps + sum(8 * p.numel() for p in params)
    assert state_bytes(opts["bf16"]) == steps + sum(4 * p.numel() for p in params)
    n = [(p.numel(), int8_quantised(p)) for g in opts["int8"].param_groups for p in g["params"]]
    assert state_bytes(opts["int8"]) == steps + sum(2 * (k + 4 * k // 256 + 1024) if q else 8 * k for k, q in n)
    assert 0.25 < state_bytes(opts["int8"]) / state_bytes(opts["fp32"]) < 0.28
    for p, st in opts["int8"].state.items():
        kind = type(st["exp_avg"]).__name__
        assert kind == ("OptimState8bit" if p.numel() >= 4096 else "Tensor"), (tuple(p.shape), kind)
        if kind == "Tensor":
            assert st["exp_avg"].dtype == torch.float32
    for st in opts["bf16"].state.values():
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16


def test_which_tensors_are_8bit():
    assert int8_quantised(torch.empty(4096))  # a 4096-wide norm weight: 8-bit (torchao does the same)
    assert not int8_quantised(torch.empty(2048))  # under 4096 values: fp32 moments
    assert not int8_quantised(torch.empty(5000))  # not whole 256-value blocks: fp32 moments
    assert int8_quantised(torch.empty(320, 128))


class _FP32State(LowPrecisionStateAdamW):
    def _zeros(self, p, signed):
        return torch.zeros_like(p)


def test_update_is_torch_adamw():
    """The shared per-parameter update with fp32 moments = torch.optim.AdamW (two groups, the LR as the
    schedule writes it, a float changed between steps)."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(16))]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW([{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:], "weight_decay": 0.0}],
                            foreach=False, **kw)
    ours = _FP32State([{"params": qs[:1], "weight_decay": 0.1}, {"params": qs[1:], "weight_decay": 0.0}], **kw)
    for step in range(10):
        for o in (ref, ours):
            for g in o.param_groups:
                g["lr"] = 1e-2 * (step + 1) / 10
        grads = [torch.randn_like(p) for p in ps]
        for p, q, g in zip(ps, qs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls", [AdamWBF16State, AdamWInt8State])
def test_state_dict_round_trip_keeps_the_moments(cls):
    """Optimizer.load_state_dict casts moments to the parameter's dtype: ours are handed back as stored
    (bf16 stays bf16; an 8-bit moment stays 8-bit), values unchanged, so a resume goes on exactly."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 128))
    opt = cls([p], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    buf = io.BytesIO()  # through bytes, as a checkpoint goes (and no tensor shared with `opt`)
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    q = torch.nn.Parameter(p.detach().clone())
    fresh = cls([q], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    fresh.load_state_dict(sd)
    a, b = opt.state[p], fresh.state[q]
    for k in ("exp_avg", "exp_avg_sq"):
        assert type(a[k]) is type(b[k]) and a[k].dtype == b[k].dtype
        if hasattr(a[k], "codes"):
            assert torch.equal(a[k].codes, b[k].codes) and torch.equal(a[k].scale, b[k].scale)
        else:
            assert b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k])
    g = torch.randn_like(p)
    p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    fresh.step()
    assert torch.equal(p, q)


class _Mesh:
    def __init__(self, *sizes):
        self.sizes = sizes

    def size(self, dim):
        return self.sizes[dim]


class _Sharded:
    """What check_int8_shards reads of an FSDP2 DTensor parameter: shape, placements, mesh sizes."""

    def __init__(self, shape, *mesh, placements=None):
        from torch.distributed.tensor import Replicate, Shard

        self.shape, self.ndim = torch.Size(shape), len(shape)
        self.device_mesh = _Mesh(*mesh)
        self.placements = placements or ([Replicate()] * (len(mesh) - 1) + [Shard(0)])

    def numel(self):
        return self.shape.numel()


def test_shards_must_be_whole_blocks():
    check_int8_shards([("w", _Sharded((128256, 4096), 8)), ("w", _Sharded((14336, 4096), 3))])  # rows of 4096: any
    check_int8_shards([("w", _Sharded((896, 896), 2, 4))])  # HSDP: 4 shards of 224 rows of 896 = 784 blocks
    check_int8_shards([("norm", _Sharded((896,), 3))])  # under 4096 values: fp32 moments, nothing to check
    with pytest.raises(ConfigError) as e:
        check_int8_shards([("layers.0.attn.q_proj.weight", _Sharded((896, 896), 3))])  # qwen2_0_5b's, 3 ranks
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("train.optimizer_state_dtype=int8: layers.0.attn.q_proj.weight (896, 896)")
    assert "[267904, 267008]" in msg and "multiple of 2 of its 896 rows" in msg and "=bf16" in msg


def test_bad_settings_are_one_clear_line(monkeypatch):
    with pytest.raises(ConfigError, match="optimizer_state_dtype") as e:
        load_config(None, ["--train.optimizer_state_dtype=fp16"])
    assert "\n" not in str(e.value)
    model = torch.nn.Linear(64, 64)
    t = load_config(None, ["--train.optimizer_state_dtype=int8"]).train
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if torchao were not installed
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    with pytest.raises(ConfigError) as e:
        build_optimizer(model, t, CPU)
    assert str(e.value) == "train.optimizer_state_dtype=int8 needs torchao (not installed): pip install 'shardlm[fp8]'"


def test_planner_holds_the_state_the_trainer_holds():
    """`shardlm plan`'s optimizer bytes (FakeTensorMode, the trainer's classes via warm_optimizer) follow the
    dtype: bf16 half of fp32's, int8 ~ a quarter (the real-vs-planned check: test_plan_accuracy_optim.py)."""
    from shardlm.plan import plan

    opt = {}
    for d in ("fp32", "bf16", "int8"):
        cfg = load_config(None, ["--model.preset=debug", "--data.seq_len=64", f"--train.optimizer_state_dtype={d}"])
        opt[d] = plan(cfg, world_size=2, gpu_mem_gib=80, gpus_per_node=2, alternatives=False).base.model_state.optimizer
    assert opt["bf16"] == pytest.approx(opt["fp32"] / 2, rel=0.01)
    assert 0.25 * opt["fp32"] < opt["int8"] < 0.28 * opt["fp32"], opt


def test_resume_under_another_state_dtype_converts():
    """fp32 moments loaded into a bf16 run are rounded to bf16 (not kept fp32); the optimizer remembers what
    the checkpoint held (`resumed_state_dtype`, for the trainer's log) and keeps its own dtype in its groups."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    fp32 = build_optimizer(model, load_config(None, []).train, CPU)
    for _ in range(2):
        model(torch.randn(4, 32)).sum().backward()
        fp32.step()
        fp32.zero_grad()
    buf = io.BytesIO()
    torch.save(fp32.state_dict(), buf)
    buf.seek(0)
    bf16 = build_optimizer(model, load_config(None, ["--train.optimizer_state_dtype=bf16"]).train, CPU)
    assert bf16.resumed_state_dtype is None
    bf16.load_state_dict(torch.load(buf, weights_only=True))
    assert bf16.resumed_state_dtype == "fp32" and {g["state_dtype"] for g in bf16.param_groups} == {"bf16"}
    for p in model.parameters():
        got, want = bf16.state[p]["exp_avg_sq"], fp32.state[p]["exp_avg_sq"]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
