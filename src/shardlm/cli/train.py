"""`shardlm train [--config FILE] [--section.key=value ...]`: train (alone, or under torchrun)."""

from __future__ import annotations

import argparse

TAKES_OVERRIDES = True


def add_args(p: argparse.ArgumentParser) -> None:
    from shardlm.config import describe

    p.usage = "shardlm train [--config FILE] [--section.key=value ...]"
    p.epilog = "config keys (each one also a --section.key=value override):\n" + describe()
    p.add_argument("--config", metavar="FILE", help="TOML config file (e.g. configs/debug.toml); "
                   "--section.key=value overrides are applied on top of it")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardlm.config import load_config
    from shardlm.train.trainer import train

    train(load_config(args.config, overrides))
    return 0
