"""`shardlm presets`: list the model presets."""

from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardlm.models import PRESETS  # lazy: keeps torch out of --help

    def size(n: int) -> str:
        return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"

    width = max(map(len, PRESETS))
    for name, c in PRESETS.items():
        ffn = (f"experts={c.n_experts} top-{c.n_experts_per_tok} expert_ffn={c.moe_ffn_dim} "
               f"({size(c.num_params(active=True))} active)" if c.n_experts else f"ffn={c.ffn_dim}")
        print(f"{name:<{width}} {size(c.num_params()):>7}  dim={c.dim} layers={c.n_layers} heads={c.n_heads}/"
              f"{c.n_kv_heads} {ffn} vocab={c.vocab_size}")
    return 0
