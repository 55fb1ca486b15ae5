"""`shardlm train | presets` (thin: parse, call)."""

from __future__ import annotations

import json
import os
import sys

USAGE = """usage: shardlm <command> [options]

commands:
  train  --config FILE [--section.key=value ...]   train (alone, or under torchrun -m shardlm train ...)
  train  --help                                     every config key, its default and what it does
  convert dcp-to-hf CHECKPOINT OUT [--merge-lora] [--adapter-only] [--dtype bf16|fp32] [--tokenizer DIR]
  convert hf-to-dcp HF_DIR OUT [--dtype fp32|bf16]
  plan   --config FILE --nodes N --gpus-per-node G --gpu-mem-gib M [--json] [--headroom 0.1] [--no-alternatives] [--section.key=value ...]
                                                    per-rank memory before launch: does it fit, and if not, what would
  make-debug-hf OUT                                 a tiny HF-format model + SFT data (for debug_lora.toml)
  presets                                           list the model presets
"""


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _train(args: list[str]) -> int:
    from shardlm.config import describe, load_config
    from shardlm.errors import ConfigError

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

    from shardlm.train.trainer import Trainer

    trainer = None
    try:
        trainer = Trainer(cfg)
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        else:  # the Trainer failed part-way: still free the process group it may have joined
            from shardlm.distributed.env import shutdown_distributed

            shutdown_distributed()
    return 0


def _convert(args: list[str]) -> int:
    import argparse
    import json
    from pathlib import Path

    from shardlm.errors import ConfigError

    ap = argparse.ArgumentParser(prog="shardlm convert", exit_on_error=False)
    sub = ap.add_subparsers(dest="direction", required=True)
    d2h = sub.add_parser("dcp-to-hf", exit_on_error=False)
    d2h.add_argument("checkpoint")
    d2h.add_argument("out")
    d2h.add_argument("--merge-lora", action="store_true", help="fold the LoRA adapters into the weights")
    d2h.add_argument("--adapter-only", action="store_true", help="write a peft adapter instead")
    d2h.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    d2h.add_argument("--tokenizer", default=None, help="directory whose tokenizer files to copy")
    h2d = sub.add_parser("hf-to-dcp", exit_on_error=False)
    h2d.add_argument("hf_dir")
    h2d.add_argument("out")
    h2d.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32")
    try:
        a = ap.parse_args(args)
    except (argparse.ArgumentError, SystemExit) as e:
        if isinstance(e, SystemExit) and e.code == 0:
            return 0
        raise ConfigError(f"convert: {e}; see `shardlm --help`") from None
    from shardlm import hf_io

    if a.direction == "hf-to-dcp":
        hf_io.import_hf_to_dcp(a.hf_dir, a.out, dtype=a.dtype)
        print(f"wrote DCP checkpoint {a.out} (model only; train with checkpoint.resume={a.out})")
        return 0
    ck = Path(a.checkpoint)
    if not (ck / ".metadata").is_file():
        raise ConfigError(f"{ck} is not a complete shardlm checkpoint (no .metadata); pass a step-N directory")
    source = json.loads((ck / "hf_source.json").read_text()) if (ck / "hf_source.json").is_file() else {}
    if a.adapter_only:
        hf_io.export_peft_adapter(ck, a.out, base_model_name_or_path=source.get("init_from", "")[3:] or None)
        print(f"wrote peft adapter to {a.out} (adapter_model.safetensors, adapter_config.json)")
        return 0
    lora = json.loads((ck / "lora_config.json").read_text()) if (ck / "lora_config.json").is_file() else {}
    if lora.get("adapters_only"):
        raise ConfigError(f"{ck} holds LoRA adapters only (lora.adapters_only): export them with --adapter-only "
                          "and load them on the base model with peft")
    tok = a.tokenizer or source.get("tokenizer")
    tok = None if tok in (None, "bytes") else (Path(tok) if Path(tok).is_dir() else Path(tok).parent)
    overrides = {}
    base = source.get("init_from", "")[3:]
    if base and (Path(base) / "config.json").is_file():  # keep the base's context length, not our seq_len
        base_cfg = json.loads((Path(base) / "config.json").read_text())
        if "max_position_embeddings" in base_cfg:
            overrides["max_position_embeddings"] = base_cfg["max_position_embeddings"]
    info = hf_io.export_hf(ck, a.out, dtype=a.dtype, merge_lora=a.merge_lora, tokenizer_dir=tok,
                           hf_config_overrides=overrides or None)
    print(f"wrote HF model to {a.out}: {len(info['files'])} safetensors file(s), {info['total_size'] / 1e6:.1f} MB")
    return 0


def _make_debug_hf(args: list[str]) -> int:
    from pathlib import Path

    from shardlm.errors import ConfigError

    if len(args) != 1:
        raise ConfigError("usage: shardlm make-debug-hf OUT_DIR")
    from shardlm.assets.debug_hf import make_debug_hf

    model, data = make_debug_hf(Path(args[0]))
    print(f"wrote {model} (tiny HF llama + tokenizer) and {data} (SFT prompt/completion pairs)")
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
    from shardlm.errors import ConfigError, ShardlmError

    try:
        if cmd == "train":
            return _train(rest)
        if cmd == "presets":
            return _presets()
        if cmd == "convert":
            return _convert(rest)
        if cmd == "make-debug-hf":
            return _make_debug_hf(rest)
        if cmd == "plan":
            from shardlm.plan import plan_command

            return plan_command(rest)
        raise ConfigError(f"unknown command {cmd!r}; commands: train, plan, convert, make-debug-hf, presets")
    except ShardlmError as e:
        _report(f"shardlm: error: {e}")
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
