"""QLoRA test pieces shared by tests/distributed/test_qlora_fsdp.py, test_qlora_hsdp.py and test_single_rank.py:
a tiny HF llama whose linears split into whole NF4 groups, the run's overrides, the one-process reference."""

from __future__ import annotations

import json
from pathlib import Path

DIMS = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
STEPS = 8


def make_hf(out: Path) -> Path:
    """A tiny random HF llama whose every linear splits into whole NF4 groups on 2 ranks."""
    import torch
    import transformers

    from shardlm.assets.debug_hf import make_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out, vocab_size=320)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), max_position_embeddings=512, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False, initializer_range=0.2, **DIMS)
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(out, safe_serialization=True)
    return out


def qlora_overrides(out, corpus, hf, **extra) -> list[str]:
    """QLoRA (NF4 base, rank 8) on `hf` for STEPS steps, fp32 compute, 2 sequences of 64 tokens per rank."""
    o = {"model.init_from": f"hf:{hf}", "data.tokenizer": f"{hf}/tokenizer.json", "data.path": str(corpus),
         "data.cache_dir": str(Path(out).parent / "cache"), "data.seq_len": 64, "train.output_dir": str(out),
         "train.mixed_precision": "fp32", "train.micro_batch_size": 2, "train.lr": 1e-2, "train.warmup_steps": 1,
         "train.steps": STEPS, "lora.rank": 8, "lora.alpha": 16, "lora.base_dtype": "nf4",
         "metrics.log_every": 1, "metrics.progress_bar": False}
    o.update(extra)
    return [f"--{k}={v}" for k, v in o.items()]


def nf4_reference(cfg, mc, hf: str, lora_sd: dict):
    """One process, no FSDP: our Transformer on the HF weights with every LoRA base replaced by
    `to_nf4(W in bf16)` dequantised, the given adapters, fp32."""
    import torch
    from safetensors.torch import load_file

    from shardlm.interop.hf.names import hf_key_to_ours
    from shardlm.lora import apply_lora
    from shardlm.models import Transformer
    from shardlm.quant.nf4 import nf4_roundtrip

    sd = {}
    for f in sorted(Path(hf).glob("*.safetensors")):
        sd.update({hf_key_to_ours(k): v for k, v in load_file(f).items()})
    torch.manual_seed(0)
    ref = Transformer(mc)
    apply_lora(ref, cfg.lora.rank, cfg.lora.alpha, 0.0, cfg.lora.targets)
    for name, m in ref.named_modules():
        if hasattr(m, "lora_A"):
            sd[f"{name}.weight"] = nf4_roundtrip(sd[f"{name}.weight"]).float()
    sd.update(lora_sd)
    ref.load_state_dict(sd, strict=False)
    ref.rope.reset_parameters()
    return ref


def nf4_state(model) -> dict:
    """Each NF4 parameter's local inner tensors (cloned): to compare two models' NF4 shards bit for bit."""
    from shardlm.quant.nf4 import nf4_params

    return {name: [getattr(p._local_tensor, a).clone() for a in ("quantized_data", "quantized_scalers",
                                                                 "quantization_factor", "scaler_mean")]
            for name, (_, _, p) in nf4_params(model).items()}
