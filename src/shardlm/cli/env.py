"""`shardlm env`: check this node before launching (`--check`, the default), or print the NCCL presets."""

from __future__ import annotations

import argparse

from shardlm.distributed import check
from shardlm.distributed.nccl import format_list, format_preset, resolve
from shardlm.errors import ConfigError

TAKES_OVERRIDES = False


def add_args(p: argparse.ArgumentParser) -> None:
    p.usage = "shardlm env [--check] [--json] | --list | --preset NAME"
    p.epilog = ("--check reports versions, launcher variables, GPUs and their topology, network devices, "
                "nccl.conf and\nthe NCCL/torch/CUDA/gloo variables set, then the obvious mistakes with their fixes "
                "(a GLOO_SOCKET_IFNAME or\nTORCH_NCCL_ASYNC_ERROR_HANDLING that stops the process group, an "
                "NCCL_CONF_FILE NCCL cannot read, ...).\nPaste it into bug reports.\n"
                "exit code (--check): 0 if no problem was found, 1 if one was.")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--check", action="store_true", help="check this node (the default)")
    what.add_argument("--list", action="store_true", help="list the NCCL presets")
    what.add_argument("--preset", metavar="NAME", help="print one NCCL preset's settings (`auto`: detect)")
    p.add_argument("--json", action="store_true", help="with --check: print the report as JSON")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.list or args.preset is not None:
        if args.json:
            raise ConfigError("env: --json goes with --check, not --list/--preset; see `shardlm env --help`")
        if args.list:
            print(format_list())
        else:
            preset, why = resolve(args.preset)
            if args.preset == "auto":
                print(f"# {why}")
            print(format_preset(preset))
        return 0
    report = check.run_check()
    print(report.to_json() if args.json else report.format())
    return 1 if report.problems else 0
