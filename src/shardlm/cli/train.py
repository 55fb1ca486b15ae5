"""`shardlm train [--config FILE] [--section.key=value ...]`: train (alone, under torchrun, or on
`--nproc-per-node N` ranks this command starts itself)."""

from __future__ import annotations

import argparse

from shardlm.config import describe, load_config
from shardlm.distributed.launcher import launch, options
from shardlm.errors import ConfigError

TAKES_OVERRIDES = True


def add_args(p: argparse.ArgumentParser) -> None:
    p.usage = ("shardlm train [--config FILE] [--section.key=value ...] [--nproc-per-node N [--nnodes N|MIN:MAX "
               "--rdzv-endpoint HOST:PORT --rdzv-id ID] [--max-restarts K]]")
    p.epilog = "config keys (each one also a --section.key=value override):\n" + describe()
    p.add_argument("--config", metavar="FILE", help="TOML config file (e.g. configs/debug.toml); "
                   "--section.key=value overrides are applied on top of it")
    launch = p.add_argument_group(
        "launch", "start the ranks here (torch's elastic agent, as torchrun does; one line per failed rank, the "
        "error's exit code) instead of `torchrun ... -m shardlm train`")
    launch.add_argument("--nproc-per-node", metavar="N", help="ranks on this node (a number, or `gpu`: one per GPU)")
    launch.add_argument("--nnodes", default="1", metavar="N", help="nodes (N, or MIN:MAX); each node runs this "
                        "command (default 1)")
    launch.add_argument("--rdzv-endpoint", default="", metavar="HOST:PORT",
                        help="the c10d rendezvous on the first node (needed with --nnodes above 1)")
    launch.add_argument("--rdzv-id", default="", metavar="ID", help="the same on every node (default: $SLURM_JOB_ID)")
    launch.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="restart the ranks up to K times after a failure (they resume from the last "
                             "complete checkpoint)")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = load_config(args.config, overrides)  # a bad key or value: one line now, before any rank starts
    if args.nproc_per_node is None:
        if args.nnodes != "1" or args.rdzv_endpoint or args.rdzv_id or args.max_restarts:
            raise ConfigError("--nnodes, --rdzv-endpoint, --rdzv-id and --max-restarts go with --nproc-per-node N "
                              "(or use torchrun's own flags)")
        from shardlm.train.trainer import train  # lazy: keeps torch out of --help

        train(cfg)
        return 0
    opts = options(args.nproc_per_node, args.nnodes, args.rdzv_endpoint, args.rdzv_id, args.max_restarts)
    return launch(opts, ["train", *(["--config", args.config] if args.config else []), *overrides])
