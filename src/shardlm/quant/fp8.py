"""FP8 training through torchao: float8 linears (tensorwise or rowwise scaling) on top of bf16.

Applied to the plain model before activation checkpointing, compile and FSDP. Only exact
`nn.Linear` layers whose in/out features are multiples of 16 are converted; the output head
(`lm_head`) stays bf16 (its logits feed the loss), and so do LoRA layers (their base is frozen and
their adapters are tiny). With tensorwise scaling on CUDA, FSDP all-gathers the weights in float8
(half the bytes of bf16); gloo has no float8 collectives, so that path is NCCL-only.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import torch
from torch import nn

from shardlm.errors import ConfigError
from shardlm.extras import require


def _float8() -> ModuleType:
    """torchao.float8, imported on first use (torchao is the [fp8] extra, and slow and noisy to import)."""
    return require("torchao.float8", "fp8", "train.mixed_precision=fp8")


def check_fp8_hardware(device: torch.device, emulate: bool) -> None:
    """FP8 matmuls need compute capability >= 8.9 (Ada, Hopper, Blackwell) unless emulated."""
    if emulate:
        return
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
        raise ConfigError(f"train.mixed_precision=fp8 needs FP8 matmuls (H100/H200/B200/L40S-class GPU) and "
                          f"{where} has none; use bf16, or set train.fp8_emulate=true to emulate them (slow, for tests)")


def fp8_all_gather(recipe: str, device: torch.device) -> bool:
    """Float8 all-gather in FSDP: tensorwise scaling only, and only over NCCL."""
    return recipe == "tensorwise" and device.type == "cuda"


def float8_config(recipe: str, emulate: bool, all_gather: bool):
    """torchao's Float8LinearConfig of `recipe`, with the float8 all-gather on or off.

    force_recompute_fp8_weight_in_bwd stays off: torchao deprecated it (ao#2251); with FSDP2 the
    unsharded float8 weight is freed after forward anyway (reshard_after_forward), and AC covers the rest.
    """
    return dataclasses.replace(_float8().Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                               enable_fsdp_float8_all_gather=all_gather, force_recompute_fp8_weight_in_bwd=False)


def apply_fp8(model: nn.Module, recipe: str, emulate: bool, all_gather: bool) -> list[str]:
    """Swap eligible linears for torchao Float8Linear; returns their names."""
    float8 = _float8()
    config = float8_config(recipe, emulate, all_gather)
    converted: list[str] = []

    def eligible(module: nn.Module, fqn: str) -> bool:
        ok = (type(module) is nn.Linear and fqn.split(".")[-1] != "lm_head"
              and module.in_features % 16 == 0 and module.out_features % 16 == 0)
        if ok:
            converted.append(fqn)
        return ok

    float8.convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    return converted


def precompute_fp8_scales(model: nn.Module) -> None:
    """After the optimizer step, one all-reduce computes every float8 weight's scale (all-gather path);
    without it each block's all-gather would all-reduce its own weights' amax first (step 1 does)."""
    _float8().precompute_float8_dynamic_scale_for_fsdp(model)
