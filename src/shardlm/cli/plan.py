"""`shardlm plan`: per-rank memory of one training step before launch; exit 0 if it fits, 3 if not."""

from __future__ import annotations

import argparse
import math

from shardlm.config import load_config
from shardlm.errors import PLAN_DOES_NOT_FIT, ConfigError

TAKES_OVERRIDES = True


def add_args(p: argparse.ArgumentParser) -> None:
    p.usage = ("shardlm plan [--config FILE] --gpu-mem-gib M[,M...] [--max KEY] [--nodes N] [--gpus-per-node G] "
               "[--headroom F] [--json] [--no-alternatives] [--exact] [--document-attention A] [--section.key=value ...]")
    p.epilog = ("exit code: 0 if the config fits (with --max: if some value fits every size), 3 if it does not.\n"
                "--section.key=value overrides the config (see `shardlm train --help`).")
    p.add_argument("--config", metavar="FILE", help="TOML config file (default: the built-in defaults)")
    p.add_argument("--nodes", type=int, default=1, metavar="N", help="number of nodes (default: 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="G", help="GPUs per node (default: 8)")
    p.add_argument("--gpu-mem-gib", type=_sizes, required=True, metavar="M",
                   help="memory of one GPU, in GiB; with --max, a comma-separated row of sizes (e.g. 24,48,80)")
    p.add_argument("--max", default=None, metavar="KEY", choices=("data.seq_len", "train.micro_batch_size"),
                   help="instead of one plan: the largest data.seq_len (steps of 128) or train.micro_batch_size that "
                        "fits, for each --gpu-mem-gib size")
    p.add_argument("--headroom", type=float, default=None, metavar="F",
                   help="fraction of each GPU kept free for what is not modelled (default: 0.1)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-alternatives", dest="alternatives", action="store_false",
                   help="do not search for knobs that would make it fit")
    p.add_argument("--exact", action="store_true", help="run every layer (no extrapolation from shorter models)")
    p.add_argument("--document-attention", choices=("auto", "flex", "sdpa-mask"), default=None, metavar="A",
                   help="attention planned for data.document_mask: auto (default: flex, as the trainer runs on CUDA "
                        "GPUs), flex, or sdpa-mask (a dense mask: GPUs without triton, CPUs)")


def _sizes(text: str) -> list[float]:
    try:
        sizes = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GiB as a number or a comma-separated list, got {text!r}") from None
    if not all(math.isfinite(x) and x > 0 for x in sizes):
        raise argparse.ArgumentTypeError(f"GPU sizes must be finite numbers of GiB > 0, got {text!r}")
    return sizes


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardlm.plan import plan, plan_max  # lazy: keeps torch out of --help

    cfg = load_config(args.config, overrides)
    opt = {} if args.headroom is None else {"headroom": args.headroom}
    if args.document_attention is not None:
        opt["document_attention"] = args.document_attention
    sizes = args.gpu_mem_gib
    if args.max is not None:
        rep = plan_max(cfg, args.max, args.nodes * args.gpus_per_node, sizes, args.gpus_per_node, **opt,
                       exact=args.exact, with_cp=True)
        print(rep.to_json() if args.json else rep.format())
        return 0 if all(r.value is not None for r in rep.rows) else PLAN_DOES_NOT_FIT
    if len(sizes) > 1:
        raise ConfigError(f"plan: --gpu-mem-gib takes one size ({len(sizes)} given); a row of sizes goes with --max "
                          "data.seq_len or --max train.micro_batch_size")
    report = plan(cfg, args.nodes * args.gpus_per_node, sizes[0], args.gpus_per_node, **opt,
                  alternatives=args.alternatives, exact=args.exact)
    print(report.to_json() if args.json else report.format())
    return 0 if report.fits else PLAN_DOES_NOT_FIT
