"""`shardlm presets`: list the model presets."""

from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardlm.models import PRESETS

    for name, c in PRESETS.items():
        print(f"{name:<12} {c.num_params() / 1e9:8.3f}B  dim={c.dim} layers={c.n_layers} heads={c.n_heads}/"
              f"{c.n_kv_heads} ffn={c.ffn_dim} vocab={c.vocab_size}")
    return 0
