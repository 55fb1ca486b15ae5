"""`shardlm presets`: list the model presets."""

from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardlm.models import PRESETS  # lazy: keeps torch out of --help

    for name, c in PRESETS.items():
        n = c.num_params()
        size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        print(f"{name:<12} {size:>7}  dim={c.dim} layers={c.n_layers} heads={c.n_heads}/"
              f"{c.n_kv_heads} ffn={c.ffn_dim} vocab={c.vocab_size}")
    return 0
