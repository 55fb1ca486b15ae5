"""`shardlm eval (--hf DIR | --checkpoint DIR) --tasks a,b`: lm-evaluation-harness tasks on a model."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from shardlm.cli.generate import add_model_source
from shardlm.config import load_config
from shardlm.errors import ConfigError
from shardlm.extras import quiet_imports, require

TAKES_OVERRIDES = True


def add_args(p: argparse.ArgumentParser) -> None:
    p.usage = ("shardlm eval (--hf DIR | --checkpoint DIR) --tasks A,B [--include-path DIR] [--num-fewshot N] "
               "[--limit N] [--batch-size N] [--output FILE.json] [--log-samples] [--train.device=cpu ...]")
    p.description = (
        "Run lm-evaluation-harness tasks on a model from an HF folder or a DCP checkpoint (model-only or full; LoRA\n"
        "adapters are merged on the fly), with no conversion to HF first. It scores as lm-eval's HF backend does\n"
        "(`shardlm.eval.harness`): loglikelihood, loglikelihood_rolling (perplexity) and generate_until tasks.\n"
        "One process for a model that fits one device; under torchrun the model is sharded and every rank runs\n"
        "every request in lockstep; rank 0 prints the results table and writes --output. Needs the [eval] extra.")
    p.epilog = ("Tasks: lm-eval's own (their data sets come from the HF hub, or offline from the datasets cache,\n"
                "HF_DATASETS_CACHE: an uncached one fails at once when the hub is off or does not answer) and those\n"
                "in --include-path (task YAMLs, e.g. over a local jsonl: dataset_path: json, dataset_kwargs:\n"
                "{data_files: ...}).\n--section.key=value "
                "overrides: train.device (auto/cpu/cuda), train.mixed_precision (auto = bf16 on GPUs, fp32 on CPU),\n"
                "parallel.* under torchrun.")
    add_model_source(p)
    p.add_argument("--tasks", required=True, metavar="A,B", help="comma-separated task (or group) names")
    p.add_argument("--include-path", metavar="DIR", help="a folder of extra task YAMLs")
    p.add_argument("--num-fewshot", type=int, metavar="N", help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--limit", type=float, metavar="N", help="at most N documents per task (< 1: that fraction)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="windows (or prompts) per forward (8)")
    p.add_argument("--max-length", type=int, metavar="N", help="the window the model reads (default: its context)")
    p.add_argument("--max-gen-toks", type=int, default=256, metavar="N",
                   help="new tokens per generate_until request unless the task sets max_gen_toks (256)")
    p.add_argument("--seed", type=int, help="lm-eval's random, numpy, torch and few-shot seeds (default: lm-eval's)")
    p.add_argument("--bootstrap-iters", type=int, default=100000, metavar="N",
                   help="bootstrap resamples for the stderr of metrics without a formula (100000; 0 = none)")
    p.add_argument("--apply-chat-template", action="store_true", help="render prompts with the tokenizer's template")
    p.add_argument("--tokenizer", metavar="SPEC", help="a tokenizer.json, its folder, or bytes (default: the model's)")
    p.add_argument("--output", metavar="FILE.json", help="write lm-eval's results (and --log-samples) as JSON")
    p.add_argument("--log-samples", action="store_true",
                   help="include every document's requests and scores in --output")


def _task_manager(tasks: list[str], include_path: str | None):
    """lm-eval's TaskManager that knows `tasks`: --include-path's alone when it has them all (no scan of lm-eval's
    thousands of built-in task files), else with the built-in ones. ConfigError for a name neither knows."""
    import difflib

    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"--include-path {include_path}: not a folder")
    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        near = [m for t in unknown for m in difflib.get_close_matches(t, manager.all_tasks, n=3)]
        hint = f"; did you mean {', '.join(near)}?" if near else "; `lm-eval ls tasks` lists them"
        local = f" (nor in {include_path})" if include_path else " (for your own task YAMLs: --include-path DIR)"
        raise ConfigError(f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}{local}{hint}")
    return manager


HUB_FIX = ("run the eval once where the hub is reachable (that fills the cache), point HF_DATASETS_CACHE at a copy "
           "of a cache that has the data, or evaluate a task YAML over local files (--include-path; "
           "docs/generate-eval.md: local tasks)")


def hub_datasets(manager, tasks: list[str]) -> dict[str, tuple[str, str | None]]:
    """task -> (HF hub dataset, its config) for each task of `tasks` (groups and tags expanded) that lm-eval loads
    from the hub: a `dataset_path` that `datasets.load_dataset` looks up there (a repo id, not one of its
    packaged builders such as json, nor a local folder). Left out: tasks with their own loader (custom_dataset,
    a Python class), remote data_files, and everything where lm-eval's index is not the Entry objects of 0.4.13."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    index, out, seen = getattr(manager, "task_index", {}), {}, set()

    def children(spec) -> list:
        return spec if isinstance(spec, list) else [spec]

    def visit(spec) -> None:  # a name, or a group's child: {task: name, overrides...} or an inline {group: ...}
        if isinstance(spec, dict) and "group" in spec:
            for child in children(spec.get("task")):
                visit(child)
            return
        name = spec.get("task") if isinstance(spec, dict) else spec
        if not isinstance(name, str) or name in seen:
            return
        seen.add(name)
        entry = index.get(name)
        kind = getattr(getattr(entry, "kind", None), "name", None)
        if kind == "TAG":
            for member in sorted(entry.tags):
                visit(member)
        elif kind == "GROUP":
            for child in children((entry.cfg or {}).get("task")):
                visit(child)
        elif kind == "TASK":
            cfg = {**(entry.cfg or {}), **(spec if isinstance(spec, dict) else {})}
            path = cfg.get("dataset_path")
            if (isinstance(path, str) and not cfg.get("custom_dataset") and path not in _PACKAGED_DATASETS_MODULES
                    and not os.path.isdir(path) and path.count("/") <= 1 and not path.startswith((".", "~"))):
                out[name] = (path, cfg.get("dataset_name"))

    for task in tasks:
        visit(task)
    return out


def dataset_cached(path: str, config: str | None, cache_dir: str) -> bool:
    """Is hub dataset `path` (`config`) in the datasets cache where `datasets.load_dataset` finds it offline:
    <cache>/<namespace>___<name>/<config>[-<kwargs hash>]/<version>/<hash>/ (its CachedDatasetModuleFactory)?"""
    from datasets.naming import camelcase_to_snakecase

    parts = path.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    root = Path(cache_dir).expanduser() / "___".join(parts)
    return any(p.is_dir() and (config is None or p.parts[-3] == config or p.parts[-3].startswith(config + "-"))
               for p in root.glob("*/*/*"))


def hub_unreachable(endpoint: str, timeout_s: float = 3.0) -> str | None:
    """Why `endpoint` (the HF hub) does not answer within `timeout_s`, or None when it does (any HTTP status).
    urllib honours https_proxy."""
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as e:  # URLError (DNS, refused), a timeout, a malformed HF_ENDPOINT
        return str(getattr(e, "reason", None) or e)
    return None


def check_hub_data(manager, tasks: list[str], environ=os.environ) -> None:
    """Fail at once (ConfigError) when a task's HF hub dataset is not in the local datasets cache and the hub is
    off (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) or does not answer, instead of `datasets`' retries (~45 s) and a
    ConnectionError traceback. Cached and local-data tasks pass; the hub is asked only about what is not cached."""
    import datasets.config

    cache, endpoint = str(datasets.config.HF_DATASETS_CACHE), datasets.config.HF_ENDPOINT
    missing = {t: d for t, d in hub_datasets(manager, tasks).items() if not dataset_cached(*d, cache)}
    if not missing:
        return
    flags = [f"{k}={environ[k]}" for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
             if environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE")]
    if flags or datasets.config.HF_HUB_OFFLINE:
        why = f"the hub is off ({', '.join(flags) or 'offline mode'})"
    elif down := hub_unreachable(endpoint):
        why = f"{endpoint} does not answer ({down})"
    else:
        return
    named = [f"{t} needs {path}" + (f" ({config})" if config else "") for t, (path, config) in missing.items()]
    what = (f"task {named[0]} from the HF hub" if len(named) == 1 else f"{len(named)} tasks need data from the HF "
            f"hub ({', '.join(named[:4])}{', ...' if len(named) > 4 else ''})")
    raise ConfigError(f"{what}, not in the datasets cache ({cache}), and {why}; {HUB_FIX}")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from shardlm.inference import load_for_inference  # lazy: keeps torch out of --help

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("--tasks names no task; pass e.g. --tasks hellaswag,arc_easy")
    if args.batch_size < 1 or args.max_gen_toks < 1 or (args.limit is not None and args.limit <= 0) or (
            args.num_fewshot is not None and args.num_fewshot < 0) or args.bootstrap_iters < 0:
        raise ConfigError("--batch-size and --max-gen-toks must be >= 1, --limit > 0, --num-fewshot and "
                          "--bootstrap-iters >= 0")
    if args.log_samples and not args.output:
        raise ConfigError("--log-samples writes into --output; pass --output FILE.json")
    if args.output and os.environ.get("RANK", "0") == "0":  # found unwritable now, not after the evaluation
        try:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--output {args.output}: cannot create its folder ({e.strerror})") from None
    lm_eval = require("lm_eval", "eval", "`shardlm eval`")
    with quiet_imports():
        from lm_eval import evaluator, utils

        from shardlm.eval.harness import ShardlmLM  # lazy: [eval] extra (lm-eval)
    cfg = load_config(None, overrides)
    if os.environ.get("RANK", "0") != "0":  # every rank evaluates in lockstep; rank 0 speaks
        os.environ["TQDM_DISABLE"] = "1"  # lm-eval's progress bars (it sees every rank as its rank 0)
        for name in ("lm-eval", "lm_eval"):
            logging.getLogger(name).setLevel(logging.ERROR)
    manager = _task_manager(tasks, args.include_path)  # before the model: a typo fails fast
    check_hub_data(manager, tasks)  # and so does hub data that cannot be had here
    inf = load_for_inference(hf=args.hf, checkpoint=args.checkpoint, cfg=cfg, tokenizer=args.tokenizer)
    try:
        if inf.is_rank0:
            print(f"eval: {inf.describe()}", file=sys.stderr, flush=True)
        lm = ShardlmLM(inf, batch_size=args.batch_size, max_length=args.max_length, max_gen_toks=args.max_gen_toks)
        limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
        seeds = {} if args.seed is None else {f"{k}_seed": args.seed for k in ("random", "numpy_random",
                                                                               "torch_random", "fewshot_random")}
        try:
            results = evaluator.simple_evaluate(
                model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=limit, batch_size=args.batch_size,
                task_manager=manager, log_samples=args.log_samples, bootstrap_iters=args.bootstrap_iters,
                apply_chat_template=args.apply_chat_template, **seeds)
        except ConnectionError as e:  # data check_hub_data cannot foresee (remote data_files, a custom loader)
            raise ConfigError(f"a task's data could not be downloaded ({e}); {HUB_FIX}") from None
    finally:
        inf.close()
    if not inf.is_rank0 or results is None:
        return 0
    print(utils.make_table(results), flush=True)
    if results.get("groups"):
        print(utils.make_table(results, "groups"), flush=True)
    if args.output:
        out = Path(args.output)
        out.write_text(json.dumps(results, indent=2, default=utils.handle_non_serializable, ensure_ascii=False))
        print(f"eval: results written to {out} (lm-eval {getattr(lm_eval, '__version__', '?')})", file=sys.stderr,
              flush=True)
    return 0
