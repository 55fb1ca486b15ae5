"""Tiny random Hugging Face causal LMs for the HF tests (transformers imported only when called)."""

from __future__ import annotations

import torch


def tiny_hf_model(model_type: str, **config):
    """An fp32 `AutoModelForCausalLM` of `model_type` with random weights, in eval mode.

    Norm gains are drawn around 1 and biases around 0 (std 0.2), so that parity does not hinge on
    their defaults (ones and zeros), with the rest as transformers initialises it after seed 0.
    """
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in pname else 0.0))
    return model.eval()
