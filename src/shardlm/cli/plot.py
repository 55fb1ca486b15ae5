"""`shardlm plot RUN_DIR...`: loss, validation loss, learning rate, tokens/s and memory of runs, in one image."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardlm.observe.plots import metrics_file, plot_runs


def add_args(p: argparse.ArgumentParser) -> None:
    p.usage = "shardlm plot RUN_DIR [RUN_DIR ...] [--out FILE] [--x step|elapsed] [--log-loss] [--names A,B,...]"
    p.description = (
        "Draw the curves of each run's metrics.jsonl (RUN_DIR = its train.output_dir) into one image: loss with\n"
        "the validation loss dashed, learning rate, tokens/s and peak memory, against the step or the training\n"
        "time, several runs overlaid in colours named by their folders. Needs matplotlib: pip install 'shardlm[viz]'.")
    p.epilog = ("A malformed line is skipped with a warning; when a resumed run logged a step twice the later line\n"
                "wins; --x elapsed adds up the training time of a run's starts.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (or their metrics.jsonl files)")
    p.add_argument("--out", metavar="FILE",
                   help="the image to write; its suffix picks the format (.png, .svg, .pdf; "
                        "default: FIRST_RUN_DIR/plot.png)")
    p.add_argument("--x", choices=("step", "elapsed"), default="step", help="the x axis (default: step)")
    p.add_argument("--log-loss", action="store_true", help="log-scale loss axis")
    p.add_argument("--names", metavar="A,B,...",
                   help="legend names, one per run, comma-separated (default: the folder names)")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    names = args.names.split(",") if args.names is not None else None
    out = args.out or metrics_file(args.runs[0]).parent / "plot.png"
    print(plot_runs(args.runs, Path(out), x=args.x, names=names, log_loss=args.log_loss))
    return 0
