"""`shardlm prepare SOURCE... OUT_DIR`: tokenise offline, in parallel, into a token store."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardlm.config import load_config
from shardlm.data.sources import resolve_sources
from shardlm.errors import ConfigError

TAKES_OVERRIDES = True


def add_args(p: argparse.ArgumentParser) -> None:
    p.usage = ("shardlm prepare SOURCE [SOURCE ...] OUT_DIR [--workers N] [--val-fraction F | --val PATH] "
               "[--config FILE] [--data.key=value ...]")
    p.description = (
        "Tokenise SOURCEs (.txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, .arrow, HF `save_to_disk` folders,\n"
        "directories and globs of these) into the token store OUT_DIR, which training memory-maps\n"
        "(data.path = OUT_DIR). Parallel over --workers processes; the same inputs give the same bytes whatever\n"
        "the workers; a killed prepare continues where it stopped when run again; OUT_DIR appears only when\n"
        "complete. The tokenizer and text field are the training config's (--data.tokenizer, --data.text_field,\n"
        "or --model.init_from's tokenizer), so the store matches the run. --data.format sft: SFT records\n"
        "(messages, prompt/completion, alpaca) rendered with the tokenizer folder's chat template, with answer\n"
        "masks (data.format = \"sft\" trains on it).")
    p.epilog = ("--section.key=value overrides the config (see `shardlm train --help`); data.max_bad_fraction\n"
                "bounds the share of records that may be skipped as malformed.")
    p.add_argument("paths", nargs="+", metavar="SOURCE... OUT_DIR", help="sources, then the store to write")
    p.add_argument("--workers", type=int, default=0, metavar="N", help="worker processes (default: every core)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                       help="hold out this fraction of the documents (chosen by content hash and --seed) as the "
                            "validation store OUT_DIR/val")
    split.add_argument("--val", metavar="PATH", help="sources of a separate validation store OUT_DIR/val")
    p.add_argument("--seed", type=int, default=0, help="seed of the --val-fraction split (default: 0)")
    p.add_argument("--chunk-mb", type=int, default=0, metavar="MB",
                   help="a plain .jsonl is cut into units of this size for the workers (default 0: 1/64 of the "
                        "input, 1 to 64 MB)")
    p.add_argument("--verify", action="store_true", help="check an existing store's checksums and exit")
    p.add_argument("--config", metavar="FILE", help="TOML config file (default: the built-in defaults)")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardlm.data.store.format import TokenStore, is_store, store_path  # lazy: keeps numpy out of --help
    from shardlm.data.store.prepare import PrepareSpec, prepare  # lazy: keeps numpy out of --help
    from shardlm.data.tokenizer import load_tokenizer  # lazy: keeps numpy out of --help
    from shardlm.resolve import tokenizer_spec  # lazy: keeps torch out of --help

    if args.verify:
        for path in args.paths:
            store = TokenStore.open(path)
            store.verify()
            val = store.val()
            if val is not None:
                val.verify()
            print(f"{path}: ok ({store.documents:,} documents, {store.n_tokens:,} tokens"
                  + (f"; val {val.documents:,} documents" if val else "") + ")")
        return 0
    if len(args.paths) < 2:
        raise ConfigError("prepare needs at least one SOURCE and the OUT_DIR; see `shardlm prepare --help`")
    if not 0 <= args.val_fraction < 1:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.workers < 0 or args.chunk_mb < 0:
        raise ConfigError("--workers must be >= 0 (0 = every core) and --chunk-mb >= 0 (0 = auto)")
    cfg = load_config(args.config, overrides)
    *sources, out = args.paths
    for s in sources + ([args.val] if args.val else []):
        if is_store(s):
            raise ConfigError(f"source {s!r} is a token store (already tokenized): train on it directly "
                              f"(data.path = \"store:{store_path(s)}\"), or pass the raw files it was made from")
    files = list(dict.fromkeys(f for s in sources for f in resolve_sources(s, "source")))  # in the order given
    val_files = resolve_sources(args.val, "--val") if args.val else []
    tok_spec = tokenizer_spec(cfg)
    tok = load_tokenizer(tok_spec)
    sft = cfg.data.format == "sft"  # records rendered with the tokenizer folder's chat template (as training)
    spec = PrepareSpec(files, tok_spec, tok.fingerprint, cfg.data.text_field, val_fraction=args.val_fraction,
                       val_files=val_files, seed=args.seed, chunk_bytes=args.chunk_mb << 20,
                       kind=cfg.data.format, template_dir=str(tok.directory) if sft and tok.directory else None)
    prepare(spec, Path(out), workers=args.workers, max_bad_fraction=cfg.data.max_bad_fraction)
    return 0
