"""Which SDPA kernel runs causal attention in training (train.attention_backend), chosen once at startup.

auto: cuDNN attention first on Hopper (sm90) for bf16/fp16 with head_dim <= 128 (it is usually the fastest
kernel there), falling back to flash, memory-efficient and math in that order; everywhere else torch's own
order (flash on Ampere and later, the CPU kernels on CPU) is left alone. An explicit kernel is the only one
enabled, and one this device, dtype or torch cannot run stops the start with one line.

`choose_sdpa_backends` is pure (device facts in, names out: unit-tested with fake capabilities);
`sdpa_backends_for` reads the facts of a real device; `sdpa_context` is what `forward_backward` enters.
Document-masked flex attention (`models/llama.py`) is not SDPA and is not affected.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import ContextManager

import torch

from shardlm.errors import ConfigError

# config name -> torch.nn.attention.SDPBackend member
SDP_MEMBERS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
               "math": "MATH"}
AUTO_HOPPER_ORDER = ("cudnn", "flash", "efficient", "math")
CUDNN_MIN_TORCH = (2, 6)  # before 2.6, cuDNN SDPA had correctness issues and was deprioritised (pytorch#138522)
HALF = (torch.bfloat16, torch.float16)


def available_backends() -> frozenset[str]:
    """The kernels this torch build names in SDPBackend (cuDNN attention is missing from older ones)."""
    from torch.nn.attention import SDPBackend

    return frozenset(name for name, member in SDP_MEMBERS.items() if hasattr(SDPBackend, member))


def can_set_priority() -> bool:
    """Whether `sdpa_kernel` takes set_priority (the order of a list counts), needed to put cuDNN first."""
    from torch.nn.attention import sdpa_kernel

    return "set_priority" in inspect.signature(sdpa_kernel).parameters


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def choose_sdpa_backends(requested: str, device_type: str, capability: tuple[int, int] | None,
                         dtype: torch.dtype, head_dim: int, dense_mask: bool = False,
                         available: frozenset[str] = frozenset(SDP_MEMBERS), set_priority: bool = True,
                         version: tuple[int, int] = (99, 0)) -> tuple[tuple[str, ...] | None, str]:
    """(kernels in priority order, or None for torch's default; why) for train.attention_backend=`requested`.

    `dense_mask`: attention gets a (B, 1, T, T) bool mask (document masks without flex attention).
    """
    if requested != "auto":
        _check_explicit(requested, device_type, capability, dtype, head_dim, dense_mask, available)
        return (requested,), f"train.attention_backend={requested}"
    if device_type != "cuda":
        return None, f"auto on {device_type}"
    why_not = _why_not_cudnn(capability, dtype, head_dim, dense_mask, available, set_priority, version)
    if why_not:
        return None, f"auto, not cuDNN first: {why_not}"
    return AUTO_HOPPER_ORDER, f"auto: cuDNN first on sm{capability[0]}{capability[1]}, {_dt(dtype)}, " \
                              f"head_dim {head_dim}"


def _dt(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


def _why_not_cudnn(capability, dtype, head_dim, dense_mask, available, set_priority, version) -> str:
    if capability is None or capability[0] != 9:
        return f"sm{''.join(map(str, capability or ()))} is not Hopper"
    if "cudnn" not in available or version < CUDNN_MIN_TORCH:
        return f"torch {'.'.join(map(str, version))} has no dependable cuDNN attention (needs >= 2.6)"
    if not set_priority:
        return "this torch's sdpa_kernel cannot order kernels"
    if dtype not in HALF:
        return f"{_dt(dtype)} (cuDNN attention is bf16/fp16)"
    if head_dim > 128 or head_dim % 8:
        return f"head_dim {head_dim} (cuDNN is fastest up to 128, multiples of 8)"
    if dense_mask:
        return "dense document masks"
    return ""


def _check_explicit(name: str, device_type: str, capability: tuple[int, int] | None, dtype: torch.dtype,
                    head_dim: int, dense_mask: bool, available: frozenset[str]) -> None:
    """One line for an explicit kernel that cannot run here."""
    if name not in SDP_MEMBERS:
        raise ConfigError(f"train.attention_backend={name!r} is not a kernel; use auto, {', '.join(SDP_MEMBERS)}")
    problem = None
    if name not in available:
        problem = f"torch {torch.__version__} has no {name} attention"
    elif device_type != "cuda" and name in ("cudnn", "efficient"):
        problem = f"the {name} kernel runs on CUDA GPUs only (this run is on {device_type})"
    elif device_type == "cuda" and name in ("cudnn", "flash"):
        cap = capability or (0, 0)
        if cap < (8, 0):
            problem = f"the {name} kernel needs an sm80+ GPU (Ampere or later), this one is sm{cap[0]}{cap[1]}"
        elif dtype not in HALF:
            problem = f"the {name} kernel runs bf16/fp16 only, this run computes in {_dt(dtype)}"
        elif head_dim > (256 if name == "flash" else 128):
            most = 256 if name == "flash" else 128
            problem = f"the {name} kernel takes head_dim <= {most}, the model's is {head_dim}"
    if problem is None and dense_mask and name == "flash" and device_type == "cuda":
        problem = "the flash kernel takes no attention mask and data.document_mask needs one here (no flex attention)"
    if problem:
        raise ConfigError(f"train.attention_backend={name}: {problem}; use train.attention_backend=auto "
                          "(or math, which runs everywhere)")


def sdpa_backends_for(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                      dense_mask: bool = False) -> tuple[tuple[str, ...] | None, str]:
    """`choose_sdpa_backends` with the facts of `device` and of this torch."""
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return choose_sdpa_backends(requested, device.type, cap, dtype, head_dim, dense_mask, available_backends(),
                                can_set_priority(), torch_version())


def sdpa_context(backends: tuple[str, ...] | None) -> ContextManager:
    """Only `backends` may run SDPA inside, in that order (None: torch's default, nothing entered)."""
    if not backends:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    members = [getattr(SDPBackend, SDP_MEMBERS[b]) for b in backends]
    if len(members) > 1 and can_set_priority():
        return sdpa_kernel(members, set_priority=True)
    return sdpa_kernel(members)
