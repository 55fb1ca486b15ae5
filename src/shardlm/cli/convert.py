"""`shardlm convert dcp-to-hf | hf-to-dcp`: checkpoints to and from the Hugging Face format."""

from __future__ import annotations

import argparse
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
    d2h.add_argument("--expert-layout", choices=("per-expert", "fused"), default="per-expert",
                     help="a mixture of experts' weights: one tensor per expert and projection, as the published "
                          "checkpoints (default), or newer transformers' fused experts.gate_up_proj")
    h2d = sub.add_parser("hf-to-dcp", prog=f"{p.prog} hf-to-dcp",
                         help="an HF model folder -> a DCP checkpoint (model only)")
    h2d.add_argument("hf_dir", metavar="HF_DIR")
    h2d.add_argument("out", metavar="OUT")
    h2d.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32")


def run(a: argparse.Namespace, overrides: list[str]) -> int:
    if a.direction == "hf-to-dcp":
        from shardlm.interop.hf.import_ import import_hf_to_dcp  # lazy: keeps torch out of --help

        import_hf_to_dcp(a.hf_dir, a.out, dtype=a.dtype)
        print(f"wrote DCP checkpoint {a.out} (model only): start a run from it with "
              f"--model.init_from=dcp:{Path(a.out).resolve()}")
        return 0
    from shardlm.interop.hf.export import export_checkpoint  # lazy: keeps torch out of --help

    info = export_checkpoint(a.checkpoint, a.out, merge_lora=a.merge_lora, adapter_only=a.adapter_only,
                             dtype=a.dtype, tokenizer_dir=a.tokenizer, expert_layout=a.expert_layout)
    if info["kind"] == "peft":
        print(f"wrote peft adapter to {a.out} (adapter_model.safetensors, adapter_config.json)")
        return 0
    cfg = info["config"]
    ids = ", ".join(f"{k.removesuffix('_token_id')} {cfg[k]}" for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                    if cfg.get(k) is not None)
    print(f"wrote HF model to {a.out}: {len(info['files'])} safetensors file(s), {info['total_size'] / 1e6:.1f} MB"
          f"{', generation_config.json' if info['generation'] else ''}; token ids: {ids or 'none known'}")
    if info["tokenizer"] == "bytes":
        print("no HF tokenizer written: the model was trained with shardlm's byte tokenizer (ids 0-255 are the "
              "UTF-8 bytes, 256 is end-of-text); encode with list(text.encode()), decode with bytes(ids < 256)")
    elif info["tokenizer"] is None:
        print("no tokenizer written: the checkpoint records none; pass --tokenizer DIR to copy one")
    return 0
