"""`shardlm train | presets` (thin: parse, call)."""

from __future__ import annotations

import json
import os
import sys

USAGE = """usage: shardlm <command> [options]

commands:
  train  --config FILE [--section.key=value ...]   train (alone, or under torchrun -m shardlm train ...)
  train  --help                                     every config key, its default and what it does
  presets                                           list the model presets
"""


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _train(args: list[str]) -> int:
    from shardlm.config import ConfigError, describe, load_config

    if "-h" in args or "--help" in args:
        print("usage: shardlm train [--config FILE] [--section.key=value ...]\n\nconfig keys:\n" + describe())
        return 0
    config = None
    if "--config" in args:
        i = args.index("--config")
        if i + 1 >= len(args):
            raise ConfigError("--config needs a file path")
        config, args = args[i + 1], args[:i] + args[i + 2:]
    elif any(a.startswith("--config=") for a in args):
        config = next(a for a in args if a.startswith("--config="))[len("--config="):]
        args = [a for a in args if not a.startswith("--config=")]
    cfg = load_config(config, args)

    from shardlm.trainer import Trainer

    trainer = None
    try:
        trainer = Trainer(cfg)
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
    return 0


def _presets() -> int:
    from shardlm.models import PRESETS

    for name, c in PRESETS.items():
        print(f"{name:<12} {c.num_params() / 1e9:8.3f}B  dim={c.dim} layers={c.n_layers} heads={c.n_heads}/"
              f"{c.n_kv_heads} ffn={c.ffn_dim} vocab={c.vocab_size}")
    return 0


def _report(line: str) -> None:
    """Print on rank 0; under torchrun also hand the line to its failure summary (its error file)."""
    if _rank0():
        print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": line}, f)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    from shardlm.config import ConfigError, ShardlmError

    try:
        if cmd == "train":
            return _train(rest)
        if cmd == "presets":
            return _presets()
        raise ConfigError(f"unknown command {cmd!r}; commands: train, presets")
    except ShardlmError as e:
        _report(f"shardlm: error: {e}")
        return 2 if isinstance(e, ConfigError) else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
