"""`shardlm <command>`: one argparse root; a module per command, each with `add_args(parser)` and
`run(args, overrides) -> int`. A command parses its arguments and calls one library function; what
argparse does not know (`--section.key=value` config overrides, from `parse_known_args`) goes to
`shardlm.config.load_config`, for the commands that take a config (`TAKES_OVERRIDES = True`).

Building the parser imports every command module, so `shardlm --help` costs what their imports cost: a command
imports the code that needs torch (or numpy, or an extra) inside `run`, marked `# lazy:`, and the rest at the top.

Every user error (a `ShardlmError`, argparse usage errors included, as `ConfigError`) is one line
`shardlm: error: ...` on stderr (rank 0) and in torchrun's error file, and the exit code is the
error type's (`shardlm.errors`). Ctrl-C is one line `shardlm: interrupted ...` and exit 130.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from shardlm import __version__
from shardlm.cli import bench, convert, debug_assets, env, generate, plan, plot, prepare, presets, train
from shardlm.cli import eval as eval_
from shardlm.disk import DISK_ERRNOS, from_oserror
from shardlm.errors import EXIT_CODES, ConfigError, Interrupted, ShardlmError, say

# name -> (module, one-line help), in the order `shardlm --help` lists them
COMMANDS = {
    "train": (train, "train, alone or under torchrun (`train --help`: every config key)"),
    "prepare": (prepare, "tokenise data offline, in parallel, into a token store that training memory-maps"),
    "plan": (plan, "per-rank memory before launch: does it fit, and if not, what would"),
    "generate": (generate, "text from an HF folder or a checkpoint (KV cache; greedy, top-k/top-p; sharded "
                           "under torchrun)"),
    "eval": (eval_, "lm-evaluation-harness tasks on an HF folder or a checkpoint, scored as lm-eval's HF backend "
                    "(needs [eval])"),
    "convert": (convert, "checkpoints: dcp-to-hf (HF model or peft adapter), hf-to-dcp"),
    "make-debug-hf": (debug_assets, "a tiny HF-format model + SFT data (for configs/debug_lora.toml)"),
    "presets": (presets, "list the model presets"),
    "env": (env, "this node's cluster environment: versions, GPUs and NVLink, IB/EFA ports, NCCL variables and "
                 "mistakes (`--check`); the NCCL presets (`--list`, `--preset NAME`)"),
    "bench": (bench, "`bench comm`: all-gather / reduce-scatter / all-reduce bandwidth over each mesh dimension "
                     "(under torchrun), and the FSDP share of a step"),
    "plot": (plot, "loss, validation loss, learning rate, tokens/s and memory of one or more runs, in one image"),
}


class _Exit(Exception):
    """argparse is done (after --help / --version): return `status`."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one-line `ConfigError`s and that never calls sys.exit."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # `--section.key=value` must never match an option's prefix
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        cmd = self.prog.removeprefix("shardlm").strip()
        raise ConfigError(f"{cmd + ': ' if cmd else ''}{message}; see `{self.prog} --help`")

    def exit(self, status: int = 0, message: str | None = None):
        if message:
            sys.stderr.write(message)
        raise _Exit(status)


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=24, width=110)


def build_parser() -> tuple[Parser, dict[str, Parser]]:
    root = Parser(prog="shardlm", usage="shardlm <command> [options]", formatter_class=_formatter,
                  description="Train and fine-tune Llama-family LLMs with PyTorch FSDP2.",
                  epilog="`shardlm <command> --help` shows a command's options.\n\nexit codes:\n" + "\n".join(
                      f"  {code:>3}  {what}" for code, what in EXIT_CODES.items()))
    root.add_argument("--version", action="version", version=f"shardlm {__version__}")
    sub = root.add_subparsers(dest="command", title="commands", metavar="<command>", required=True)
    parsers = {}
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, prog=f"shardlm {name}", help=help_, formatter_class=_formatter,
                           description=help_[0].upper() + help_[1:] + ".")
        module.add_args(p)
        parsers[name] = p
    return root, parsers


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _report(line: str, launcher_prints: bool = True) -> None:
    """Print on rank 0; under torchrun also hand the line to its failure summary (its error file). Under
    `shardlm train --nproc-per-node` the launcher prints it (`launcher_prints`), from that file."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if _rank0() and not (launcher_prints and error_file and os.environ.get("SHARDLM_LAUNCHER")):
        say(line)
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        root, parsers = build_parser()
        if not argv:
            root.print_help()
            return 2
        if not argv[0].startswith("-") and argv[0] not in COMMANDS:
            raise ConfigError(f"unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}")
        args, overrides = root.parse_known_args(argv)
        module = COMMANDS[args.command][0]
        if overrides and not getattr(module, "TAKES_OVERRIDES", False):
            parsers[args.command].error(f"unrecognized arguments: {' '.join(overrides)}")
        return module.run(args, overrides)
    except _Exit as e:
        return e.status
    except Interrupted as e:  # Ctrl-C in training: the trainer saved (or says what stands)
        _report(f"shardlm: {e}", launcher_prints=False)  # a signal, not a failure: the launcher says nothing
        return e.exit_code
    except ShardlmError as e:
        _report(f"shardlm: error: {e}")
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C anywhere else: nothing to save
        _report("shardlm: interrupted", launcher_prints=False)
        return Interrupted.exit_code
    except OSError as e:  # a full disk where no writer named it: still one line, naming the file's disk
        if e.errno not in DISK_ERRNOS:
            raise
        err = from_oserror(e)
        _report(f"shardlm: error: {err}")
        return err.exit_code


__all__ = ["COMMANDS", "Parser", "build_parser", "main"]
