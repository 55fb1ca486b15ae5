"""GPU fast paths, their choice logic on CPU: the SDPA kernel order (fake device capabilities), how many
blocks stay unsharded after forward (parallel.reshard_after_forward), the float8 config built for CUDA
vs CPU, and the config keys. The FSDP side (prefetch, resharding) runs on 2 gloo ranks in
tests/distributed/test_prefetch.py; the speed of each on a GPU in benchmarks/gpu_mfu.py."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
from helpers.paths import ROOT

from shardlm.config import load_config
from shardlm.errors import ConfigError
from shardlm.parallel.fsdp import AUTO_HEADROOM, GIB, block_param_bytes, mp_policy, unsharded_blocks
from shardlm.train import sdpa
from shardlm.train.sdpa import AUTO_HOPPER_ORDER, choose_sdpa_backends, sdpa_backends_for

BF16, FP32 = torch.bfloat16, torch.float32
H100 = (9, 0)
A100 = (8, 0)


# --- SDPA kernel choice --------------------------------------------------------------------------------


def test_auto_puts_cudnn_first_on_hopper_bf16_head_dim_128():
    order, why = choose_sdpa_backends("auto", "cuda", H100, BF16, 128)
    assert order == AUTO_HOPPER_ORDER and order[0] == "cudnn" and order[-1] == "math"  # math: never "no kernel"
    assert "cuDNN first" in why and "sm90" in why


@pytest.mark.parametrize("case, kwargs, reason", [
    ("ampere", dict(capability=A100), "not Hopper"),
    ("blackwell", dict(capability=(10, 0)), "not Hopper"),
    ("fp32", dict(dtype=FP32), "fp32"),
    ("head_dim 256", dict(head_dim=256), "head_dim 256"),
    ("head_dim 100", dict(head_dim=100), "head_dim 100"),
    ("dense mask", dict(dense_mask=True), "dense document masks"),
    ("no cudnn in torch", dict(available=frozenset({"flash", "efficient", "math"})), "cuDNN attention"),
    ("old torch", dict(version=(2, 5)), "needs >= 2.6"),
    ("no set_priority", dict(set_priority=False), "cannot order"),
])
def test_auto_leaves_torch_default_elsewhere_on_cuda(case, kwargs, reason):
    args = dict(requested="auto", device_type="cuda", capability=H100, dtype=BF16, head_dim=128) | kwargs
    order, why = choose_sdpa_backends(**args)
    assert order is None, case
    assert reason in why, (case, why)


def test_auto_never_touches_cpu():
    assert choose_sdpa_backends("auto", "cpu", None, FP32, 64)[0] is None
    assert choose_sdpa_backends("auto", "cpu", None, BF16, 128)[0] is None


@pytest.mark.parametrize("name, device, cap, dtype, head_dim, mask, problem", [
    ("cudnn", "cpu", None, FP32, 64, False, "CUDA GPUs only"),
    ("efficient", "cpu", None, FP32, 64, False, "CUDA GPUs only"),
    ("cudnn", "cuda", (7, 0), BF16, 128, False, "sm80+"),
    ("flash", "cuda", H100, FP32, 128, False, "bf16/fp16 only"),
    ("cudnn", "cuda", H100, BF16, 256, False, "head_dim <= 128"),
    ("flash", "cuda", H100, BF16, 512, False, "head_dim <= 256"),
    ("flash", "cuda", H100, BF16, 128, True, "no attention mask"),
])
def test_explicit_kernel_that_cannot_run_is_one_config_error(name, device, cap, dtype, head_dim, mask, problem):
    with pytest.raises(ConfigError) as e:
        choose_sdpa_backends(name, device, cap, dtype, head_dim, dense_mask=mask)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"train.attention_backend={name}: ") and problem in msg, msg
    assert "use train.attention_backend=auto" in msg  # the fix


def test_explicit_cudnn_on_a_torch_without_it():
    with pytest.raises(ConfigError, match="has no cudnn attention"):
        choose_sdpa_backends("cudnn", "cuda", H100, BF16, 128, available=frozenset({"flash", "efficient", "math"}))


@pytest.mark.parametrize("name, device, cap, dtype", [
    ("cudnn", "cuda", H100, BF16), ("flash", "cuda", A100, BF16), ("efficient", "cuda", A100, FP32),
    ("math", "cuda", (7, 0), FP32), ("math", "cpu", None, FP32), ("flash", "cpu", None, FP32)])
def test_explicit_kernel_that_can_run_is_the_only_one(name, device, cap, dtype):
    assert choose_sdpa_backends(name, device, cap, dtype, 128)[0] == (name,)


def test_backends_for_reads_the_device(monkeypatch):
    """The facts come from the device: a mocked H100 gets cuDNN first, a mocked A100 torch's default."""
    monkeypatch.setattr(sdpa, "available_backends", lambda: frozenset(sdpa.SDP_MEMBERS))
    monkeypatch.setattr(sdpa, "can_set_priority", lambda: True)
    monkeypatch.setattr(sdpa, "torch_version", lambda: (2, 11))
    for cap, want in ((H100, AUTO_HOPPER_ORDER), (A100, None)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert sdpa_backends_for("auto", torch.device("cuda"), BF16, 128)[0] == want
    assert sdpa_backends_for("auto", torch.device("cpu"), BF16, 128)[0] is None


def test_this_torch_names_its_kernels():
    names = sdpa.available_backends()
    assert {"flash", "efficient", "math"} <= names
    assert sdpa.torch_version() >= (2, 0)


def _tiny_model():
    from shardlm.models import ModelConfig, Transformer

    m = Transformer(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=50,
                                max_seq_len=32))
    m.init_weights(seed=0)
    return m


def _loss(backends):
    from shardlm.train.step import forward_backward

    m = _tiny_model()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 50, (2, 16), generator=g), torch.randint(0, 50, (2, 16), generator=g)
    loss = forward_backward(m, [(x, y)], 1.0, torch.device("cpu"), sdpa_backends=backends)
    return loss.item(), m.layers[0].self_attn.q_proj.weight.grad.clone()


def test_forward_backward_runs_under_the_chosen_kernels():
    base, g0 = _loss(None)
    for backends in (("math",), ("flash",), ("flash", "math")):
        loss, g = _loss(backends)
        assert loss == pytest.approx(base, rel=1e-5), backends
        torch.testing.assert_close(g, g0, rtol=1e-4, atol=1e-6)
    with pytest.raises(RuntimeError):  # the CPU has no memory-efficient kernel: the context is in force
        _loss(("efficient",))


def test_the_hopper_priority_list_is_accepted_by_this_torch():
    """sdpa_kernel takes the auto order with set_priority (on CPU the flash/math entries then run)."""
    base = _loss(None)[0]
    assert sdpa.can_set_priority()
    assert _loss(AUTO_HOPPER_ORDER)[0] == pytest.approx(base, rel=1e-5)


# --- reshard_after_forward ------------------------------------------------------------------------------


def test_unsharded_blocks_explicit_settings():
    assert unsharded_blocks(True, 32, 10, None)[0] == 1
    assert unsharded_blocks(True, 32, 10, 80 * GIB)[0] == 1  # true is today's behaviour whatever the memory
    assert unsharded_blocks(False, 32, 10, None)[0] == 32
    assert unsharded_blocks(3, 32, 10, None)[0] == 3
    assert unsharded_blocks(99, 32, 10, None)[0] == 32


def test_unsharded_blocks_auto_only_in_memory_left_free_at_the_peak():
    block = 436 * 2**20  # a Llama-3-8B block in bf16
    spare = 6 * GIB  # what a step with one unsharded block left free at its peak (less the headroom)
    k, why = unsharded_blocks("auto", 32, block, spare)
    assert k == 1 + spare // block and 1 < k < 32  # the last block, plus as many as the spare memory holds
    assert (k - 1) * block <= spare < k * block  # so the peak grows by at most the spare: never past what fits
    assert f"{k} x" in why and "6.0 GiB free at the peak" in why and f"{AUTO_HEADROOM:.0%}" in why
    assert unsharded_blocks("auto", 32, block, spare // 4)[0] < k  # less memory, fewer blocks
    assert unsharded_blocks("auto", 4, block, spare)[0] == 4  # all of a small model
    k1, why1 = unsharded_blocks("auto", 80, 40 * GIB, spare)  # a block bigger than what is free: the last only
    assert k1 == 1 and "no block" in why1
    assert unsharded_blocks("auto", 32, block, -GIB)[0] == 1  # over the headroom already: nothing more
    assert unsharded_blocks("auto", 32, block, None) == (1, unsharded_blocks("auto", 8, 1, None)[1])  # not known: 1


def test_block_param_bytes_in_the_all_gather_dtype():
    block = _tiny_model().layers[0]
    n = sum(p.numel() for p in block.parameters())
    assert block_param_bytes(block, mp_policy("bf16", "fp32")) == 2 * n
    assert block_param_bytes(block, mp_policy("fp32", "fp32")) == 4 * n
    assert block_param_bytes(block, mp_policy("fp8", "fp32")) == 2 * n  # float8 linears all-gather <= bf16 bytes


# --- config ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, want", [("auto", "auto"), ("true", True), ("false", False), ("4", 4)])
def test_reshard_after_forward_values(value, want):
    got = load_config(None, [f"--parallel.reshard_after_forward={value}"]).parallel.reshard_after_forward
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("override, match", [
    ("--parallel.reshard_after_forward=0", "number of blocks >= 1"),
    ("--parallel.reshard_after_forward=sometimes", "reshard_after_forward expects"),
    ("--parallel.prefetch=0", "parallel.prefetch must be >= 1"),
    ("--train.attention_backend=xformers", "train.attention_backend must be one of"),
])
def test_bad_fast_path_settings_are_one_line(override, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, [override])
    assert "\n" not in str(e.value)


def test_defaults():
    cfg = load_config(None, [])
    assert (cfg.parallel.reshard_after_forward, cfg.parallel.prefetch, cfg.train.attention_backend) == \
        ("auto", 1, "auto")


# --- float8 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device, recipe, all_gather", [
    ("cuda", "tensorwise", True), ("cuda", "rowwise", False), ("cpu", "tensorwise", False)])
def test_float8_config_for_the_device(device, recipe, all_gather):
    pytest.importorskip("torchao")
    from shardlm.resolve import uses_fp8_all_gather
    from shardlm.quant.fp8 import float8_config

    cfg = load_config(None, ["--train.mixed_precision=fp8", f"--train.fp8_recipe={recipe}"])
    assert uses_fp8_all_gather(cfg, torch.device(device)) is all_gather
    c = float8_config(recipe, emulate=device == "cpu", all_gather=uses_fp8_all_gather(cfg, torch.device(device)))
    assert c.enable_fsdp_float8_all_gather is all_gather
    assert c.force_recompute_fp8_weight_in_bwd is False  # deprecated in torchao (ao#2251)
    assert c.emulate is (device == "cpu")
    want = "tensorwise" if recipe == "tensorwise" else "axiswise"  # torchao calls per-row scales axiswise
    assert c.cast_config_weight.scaling_granularity.value == want
    assert not uses_fp8_all_gather(load_config(None, ["--train.mixed_precision=bf16"]), torch.device("cuda"))


def test_trainer_precomputes_scales_after_the_optimizer_step():
    """The float8 all-gather path: precompute right after optimizer.step(), before the next forward."""
    import inspect

    from shardlm.train.trainer import Trainer

    src = inspect.getsource(Trainer.train_step)
    step, pre = src.index("self.optimizer.step()"), src.index("precompute_fp8_scales(self.model)")
    assert step < pre < src.index("self.optimizer.zero_grad")
    assert "if self.fp8_all_gather:" in src[step:pre]


# --- benchmarks/gpu_mfu.py ------------------------------------------------------------------------------


@pytest.mark.slow
def test_gpu_mfu_dry_run_on_cpu(tmp_path):
    """The benchmark's whole pipeline on CPU: the debug model, 2 steps per variant; a variant whose key this
    shardlm lacks is skipped with a line, not a crash."""
    if importlib.util.find_spec("tomli_w") is None:
        pytest.skip("tomli-w missing")
    out = tmp_path / "gpu_mfu.txt"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_mfu.py"), "--dry-run", "--out", str(out),
                        "--only", "bf16,cudnn",
                        "--variant", "nokey:--train.no_such_key=1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    text = out.read_text()
    rows = {ln.split()[0]: ln for ln in text.splitlines() if ln and ln.split()[0] in ("bf16", "cudnn", "nokey")}
    assert set(rows) == {"bf16", "cudnn", "nokey"}, text
    assert float(rows["bf16"].split()[1].replace(",", "")) > 0, rows["bf16"]  # tokens/s from the run's metrics
    assert "chosen: attention torch's default (auto on cpu), fsdp 1 of 4 blocks unsharded" in text, \
        text + p.stdout  # from the startup line
    assert "failed" in rows["cudnn"] and "CUDA GPUs only" in rows["cudnn"]  # the trainer's one line
    assert "skipped" in rows["nokey"] and "no_such_key" in rows["nokey"]


def test_gpu_memory_dry_run_on_cpu(tmp_path):
    """benchmarks/gpu_memory.py's pipeline on CPU: a `shardlm train` run, its memory records, the plan beside."""
    out = tmp_path / "gpu_memory.txt"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_memory.py"), "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    row = next(ln for ln in out.read_text().splitlines() if ln.startswith("dry-debug"))
    planned, measured = (float(x) for x in row.split()[1:3])
    assert planned > 0 and measured > 0, row  # the plan's allocated figure, the run's mem_gib
    assert row.split()[5] == "-", row  # no reserved figure off CUDA
