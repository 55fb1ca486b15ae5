"""`shardlm make-debug-hf OUT_DIR`: a tiny HF-format model + SFT data (for configs/debug_lora.toml)."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardlm.assets.debug_hf import make_debug_hf


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", metavar="OUT_DIR", type=Path, help="writes OUT_DIR/model/ and OUT_DIR/sft.jsonl")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    model, data = make_debug_hf(args.out)
    print(f"wrote {model} (tiny HF llama + tokenizer) and {data} (SFT prompt/completion pairs)")
    return 0
