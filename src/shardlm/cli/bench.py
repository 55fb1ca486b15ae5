"""`shardlm bench comm`: FSDP's collectives over each mesh dimension (nccl-tests' algbw/busbw), under torchrun."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from shardlm.config import load_config

TAKES_OVERRIDES = True


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", title="benchmarks", metavar="{comm}", required=True)
    c = sub.add_parser(
        "comm", prog=f"{p.prog} comm", help="all-gather / reduce-scatter / all-reduce per mesh dimension",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=("torchrun --nproc_per_node N -m shardlm bench comm [--config FILE] [--sizes S,S,...] "
               "[--max-size S] [--iters N] [--warmup N] [--flag-ratio F] [--json] [--save PATH] "
               "[--section.key=value ...]"),
        description=("All-gather, reduce-scatter and all-reduce over each dimension of the configured mesh, at the\n"
                     "model's FSDP message sizes and over a sweep (1 MiB x4 up to --max-size), in nccl-tests' terms\n"
                     "(algbw = S/t, busbw = algbw x (n-1)/n or 2(n-1)/n; GB = 1e9 B); flags a dimension whose busbw\n"
                     "falls far below the best one's; estimates the share of a training step the FSDP collectives\n"
                     "take. Launch it like training: gloo on CPU, NCCL on GPUs."),
        epilog=("sizes: 1MiB, 4M, 512KiB (binary), 1MB (decimal) or bytes.\n"
                "--section.key=value overrides the config (see `shardlm train --help`)."))
    c.add_argument("--config", metavar="FILE", help="TOML config file (default: the built-in defaults)")
    c.add_argument("--sizes", metavar="S,S,...", help="message sizes instead of the sweep (comma-separated)")
    c.add_argument("--max-size", metavar="S", help="largest sweep size (default: 1GiB on CUDA, 64MiB on CPU)")
    c.add_argument("--iters", type=int, default=None, metavar="N", help="timed iterations (default: 20 CUDA, 5 CPU)")
    c.add_argument("--warmup", type=int, default=None, metavar="N", help="untimed iterations (default: 5 CUDA, 1 CPU)")
    c.add_argument("--flag-ratio", type=float, default=None, metavar="F",
                   help="flag a dimension whose busbw is below F x the best one's (default: 0.25)")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument("--save", metavar="PATH", help="also write the text report to PATH (with --json too)")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardlm.bench.comm import (  # lazy: keeps torch out of --help
        DEFAULT_FLAG_RATIO,
        format_report,
        parse_size,
        run_comm_bench,
    )
    from shardlm.distributed.env import shutdown_distributed  # lazy: keeps torch out of --help

    cfg = load_config(args.config, overrides)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()] if args.sizes else None
    max_size = parse_size(args.max_size) if args.max_size else None
    ratio = DEFAULT_FLAG_RATIO if args.flag_ratio is None else args.flag_ratio
    try:
        report = run_comm_bench(cfg, sizes, max_size, args.iters, args.warmup, ratio)
    finally:
        shutdown_distributed()  # else gloo's threads can abort the exit
    if os.environ.get("RANK", "0") != "0":
        return 0
    text = format_report(report)
    print(json.dumps(report, indent=2) if args.json else text, flush=True)
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(text + "\n")
    return 0
