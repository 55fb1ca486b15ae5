"""`shardlm convert dcp-to-hf | hf-to-dcp`: checkpoints to and from the Hugging Face format."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="direction", title="directions", metavar="{dcp-to-hf,hf-to-dcp}", required=True)
    d2h = sub.add_parser("dcp-to-hf", prog=f"{p.prog} dcp-to-hf",
                         help="a shardlm DCP checkpoint -> an HF model folder (or a peft adapter)")
    d2h.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoints/step-N directory")
    d2h.add_argument("out", metavar="OUT")
    d2h.add_argument("--merge-lora", action="store_true", help="fold the LoRA adapters into the weights")
    d2h.add_argument("--adapter-only", action="store_true", help="write a peft adapter instead")
    d2h.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    d2h.add_argument("--tokenizer", default=None, metavar="DIR", help="directory whose tokenizer files to copy")
    h2d = sub.add_parser("hf-to-dcp", prog=f"{p.prog} hf-to-dcp",
                         help="an HF model folder -> a DCP checkpoint (model only)")
    h2d.add_argument("hf_dir", metavar="HF_DIR")
    h2d.add_argument("out", metavar="OUT")
    h2d.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32")


def run(a: argparse.Namespace, overrides: list[str]) -> int:
    from shardlm import hf_io
    from shardlm.errors import ConfigError

    if a.direction == "hf-to-dcp":
        hf_io.import_hf_to_dcp(a.hf_dir, a.out, dtype=a.dtype)
        print(f"wrote DCP checkpoint {a.out} (model only; train with checkpoint.resume={a.out})")
        return 0
    ck = Path(a.checkpoint)
    if not (ck / ".metadata").is_file():
        raise ConfigError(f"{ck} is not a complete shardlm checkpoint (no .metadata); pass a step-N directory")
    source = json.loads((ck / "hf_source.json").read_text()) if (ck / "hf_source.json").is_file() else {}
    if a.adapter_only:
        hf_io.export_peft_adapter(ck, a.out, base_model_name_or_path=source.get("init_from", "")[3:] or None)
        print(f"wrote peft adapter to {a.out} (adapter_model.safetensors, adapter_config.json)")
        return 0
    lora = json.loads((ck / "lora_config.json").read_text()) if (ck / "lora_config.json").is_file() else {}
    if lora.get("adapters_only"):
        raise ConfigError(f"{ck} holds LoRA adapters only (lora.adapters_only): export them with --adapter-only "
                          "and load them on the base model with peft")
    tok = a.tokenizer or source.get("tokenizer")
    tok = None if tok in (None, "bytes") else (Path(tok) if Path(tok).is_dir() else Path(tok).parent)
    overrides = {}
    base = source.get("init_from", "")[3:]
    if base and (Path(base) / "config.json").is_file():  # keep the base's context length, not our seq_len
        base_cfg = json.loads((Path(base) / "config.json").read_text())
        if "max_position_embeddings" in base_cfg:
            overrides["max_position_embeddings"] = base_cfg["max_position_embeddings"]
    info = hf_io.export_hf(ck, a.out, dtype=a.dtype, merge_lora=a.merge_lora, tokenizer_dir=tok,
                           hf_config_overrides=overrides or None)
    print(f"wrote HF model to {a.out}: {len(info['files'])} safetensors file(s), {info['total_size'] / 1e6:.1f} MB")
    return 0
