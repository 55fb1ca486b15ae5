"""One of our DCP checkpoints -> an HF model folder (or a peft adapter), offline, in bounded memory.

The pieces, each testable with plain inputs:
  plan_shards(sizes, max_bytes)   which tensors go in which output file (pure)
  iter_hf_tensors(reader, ...)    one output shard's tensors, read and converted one read batch at a time
  write_hf_folder(out, ...)       the safetensors files, the index, config.json and the tokenizer
  export_hf(...)                  the three in sequence, with the name/shape/LoRA checks first
  export_checkpoint(...)          `shardlm convert dcp-to-hf`: the policy (the checkpoint's own sidecar
                                  files, adapters-only checkpoints, the base's context length, tokenizer)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import time
from collections.abc import Iterable, Iterator, Mapping
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

import torch

from shardlm.checkpoint.lineage import Record
from shardlm.checkpoint.manager import not_a_checkpoint
from shardlm.checkpoint.meta import CheckpointMeta, tokenizer_dir_of
from shardlm.checkpoint.reader import CheckpointReader
from shardlm.config import LoraSection
from shardlm.data.chat import ChatTemplate
from shardlm.data.tokenizer import ByteTokenizer, HFTokenizer
from shardlm.disk import check_free, disk_error, mount_point
from shardlm.errors import ConfigError, StorageError
from shardlm.fsutil import pid_alive, remove, staged
from shardlm.interop.hf.config import config_to_hf
from shardlm.interop.hf.load import INDEX_FILE, SINGLE_FILE
from shardlm.interop.hf.names import (
    Source,
    expected_shapes,
    hf_sources,
    join_fused,
    natural_key,
    our_key_to_hf,
    split_lora,
    to_hf_tensors,
    validate,
)
from shardlm.interop.peft import peft_adapter_config, to_peft_state_dict
from shardlm.lora import lora_delta
from shardlm.models.llama import ModelConfig
from shardlm.models.moe import is_expert_param
from shardlm.quant.nf4 import NF4_FORM

# The stored forms our checkpoints' parameters may be held in (shardlm.build.STORED_FORMS, which sits above this
# module): a QLoRA base, saved as its NF4 pieces, is read dequantised.
STORED_FORMS = (NF4_FORM,)
OUT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
EXPERT_LAYOUTS = ("per-expert", "fused")
# Every tokenizer file transformers may save (5.x writes the chat template to chat_template.jinja): an export copies
# each one the source folder has; a folder counts as a tokenizer folder if it has one of the first three.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt")
GENERATION_CONFIG = "generation_config.json"
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
# What an export folder may hold: a folder holding anything else is not replaced (it is not an export).
EXPORT_FILES = frozenset({INDEX_FILE, "config.json", GENERATION_CONFIG, "README.md", *TOKENIZER_FILES,
                          *ADAPTER_FILES})
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
STALE_TMP_S = 24 * 3600  # another host's leftover temp folder counts as abandoned after this
READ_BATCH_BYTES = 256 * 2**20  # checkpoint bytes read per dcp.load call (one tensor if larger)

LoraPairs = Mapping[str, Mapping[str, str]]  # base weight name -> {"A": lora_A name, "B": lora_B name}


def _out_dtype(dtype: str) -> torch.dtype:
    if dtype not in OUT_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {', '.join(OUT_DTYPES)}")
    return OUT_DTYPES[dtype]


# -- the pieces ------------------------------------------------------------------------------------
def plan_shards(sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    """Group names (in the given order) into consecutive shards of at most `max_bytes` each; a tensor
    bigger than that gets a shard of its own."""
    shards: list[list[str]] = []
    used = 0
    for name, size in sizes.items():
        if shards and used + size <= max_bytes:
            shards[-1].append(name)
            used += size
        else:
            shards.append([name])
            used = size
    return shards


def iter_hf_tensors(reader: CheckpointReader, shard: Iterable[str], lora: LoraPairs, scaling: float,
                    dtype: torch.dtype, batch_bytes: int = READ_BATCH_BYTES,
                    sources: Mapping[str, Source] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors of one output shard (our names in, HF names out), one checkpoint read at a time.

    Each read is at most `batch_bytes` of checkpoint tensors (or one bigger tensor); every yield holds
    the weights that read completed, converted to `dtype`, with `W += B @ A * scaling` for the names in
    `lora`. A weight whose adapter factors are in a later read waits for them. Nothing else is kept.
    `sources` (our name -> `names.Source`; default one to one) says which HF tensors a weight becomes: a
    stacked expert weight one per expert, a fused gate_proj/up_proj pair one gate_up_proj (the up half is
    read with its gate, which must be in `shard`).
    """
    shard = list(shard)
    sources = sources or {}
    partner = {n: n.replace("experts.gate_proj", "experts.up_proj") for n in shard
               if sources.get(n) is not None and sources[n].dim1 is not None and n.endswith("experts.gate_proj")}
    needed = []
    for n in shard:
        needed.append(n)
        if n in partner:
            needed.append(partner[n])
        for m in (n, partner.get(n)):
            if m in lora:
                needed += [lora[m]["A"], lora[m]["B"]]
    loaded: dict[str, torch.Tensor] = {}
    pending = list(shard)

    def ready(m: str) -> bool:
        ab = lora.get(m)
        return m in loaded and not (ab and not (ab["A"] in loaded and ab["B"] in loaded))

    def take(m: str) -> torch.Tensor:
        w, ab = loaded.pop(m), lora.get(m)
        if ab:
            w = w.float() + lora_delta(loaded.pop(ab["A"]), loaded.pop(ab["B"]), scaling)
        return w.to(dtype).contiguous()

    for batch in reader.batches(needed, batch_bytes):
        loaded.update(reader.read(batch))
        done: dict[str, torch.Tensor] = {}
        for n in list(pending):
            if not ready(n) or (n in partner and not ready(partner[n])):
                continue
            names = [n, partner[n]] if n in partner else [n]
            for m in names:
                src = sources.get(m) or Source((our_key_to_hf(m),))
                done.update(to_hf_tensors(m, take(m), src))
            pending.remove(n)
        yield join_fused(done)


def _shard_name(i: int, n: int) -> str:
    return SINGLE_FILE if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"


def tokenizer_files(tokenizer_dir: str | os.PathLike | None) -> list[str]:
    """The tokenizer files an export copies from `tokenizer_dir` (ConfigError if it holds none)."""
    if tokenizer_dir is None:
        return []
    src = Path(tokenizer_dir)
    found = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    if not any(n in found for n in TOKENIZER_FILES[:3]):
        raise ConfigError(f"tokenizer folder {str(src)!r} holds none of {', '.join(TOKENIZER_FILES[:3])}; "
                          "pass the folder with --tokenizer DIR")
    return found


def _copy_tokenizer(tokenizer_dir: str | os.PathLike | None, out: Path) -> list[str]:
    copied = tokenizer_files(tokenizer_dir)
    for n in copied:
        shutil.copyfile(Path(tokenizer_dir) / n, out / n)
    return copied


# -- the output folder: written beside it, swapped in whole ------------------------------------------
def _aside(out: Path, kind: str) -> Path:
    """`.OUT.tmp-<host>-<pid>` (being written) or `.OUT.old-<host>-<pid>` (the previous export, mid-swap)."""
    return out.with_name(f".{out.name}.{kind}-{socket.gethostname()}-{os.getpid()}")


def clean_leftovers(out: Path, log=print) -> None:
    """What earlier exports to `out` left when they died: temp folders are removed, and a previous export
    moved aside but never replaced is put back; one line each. A live export to `out` is a ConfigError."""
    host, prefix = socket.gethostname(), f".{out.name}."
    for p in sorted(out.parent.glob(f".{glob_escape(out.name)}.*-*")) if out.parent.is_dir() else []:
        kind, _, rest = p.name[len(prefix):].partition("-")
        h, _, pid = rest.rpartition("-")
        if kind not in ("tmp", "old") or not pid.isdigit() or not h:
            continue
        live = pid_alive(int(pid)) if h == host else time.time() - p.stat().st_mtime < STALE_TMP_S
        if live:
            raise ConfigError(f"another export to {out} is running ({h}, pid {pid}: {p.name}); wait for it, "
                              f"or remove {p} if that process is gone")
        if kind == "old" and not out.exists():
            p.rename(out)
            log(f"restored the previous export {out} (an earlier export died while replacing it)")
        else:
            shutil.rmtree(p, ignore_errors=True)
            log(f"removed {p}, left by an export that died ({h}, pid {pid})")


def check_out_dir(out: Path, keep: Iterable[Path | None] = ()) -> None:
    """`out` may be replaced by an export: absent, empty, or holding only what an export writes, and
    neither holding nor inside a folder the export reads (`keep`: the checkpoint, the base, the tokenizer)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file; pass a folder for the export")
    o = out.resolve()
    for k in keep:
        if k is None:
            continue
        k = Path(k).resolve()
        if k == o or o in k.parents or k in o.parents:
            raise ConfigError(f"{out} would replace or sit inside {k}, which the export reads; pass another folder")
    if out.is_dir():
        foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir()
                         if p.is_dir() or not (p.name in EXPORT_FILES or p.name.endswith(".safetensors")))
        if foreign:
            raise ConfigError(f"{out} holds files an export does not write ({', '.join(foreign[:3])}"
                              f"{', ...' if len(foreign) > 3 else ''}), so it is not replaced; pass a new or "
                              "empty folder")


def check_free_space(out: Path, need_bytes: int) -> None:
    """StorageError if the filesystem of `out` has less than `need_bytes` (+5%) free (the previous export,
    if any, stays until the new one is complete)."""
    check_free(out.resolve(), need_bytes * 1.05, lambda free, p: StorageError(
        f"not enough free space for the export in {p} (disk {mount_point(p)}): it needs {need_bytes / 1e9:.2f} "
        f"GB, {free / 1e9:.2f} GB are free; free space there or pass another folder"))


@contextlib.contextmanager
def written_aside(out: Path, need_bytes: int | None = None) -> Iterator[Path]:
    """Yield a temp folder beside `out` to write into (`fsutil.staged`); on success it replaces `out` whole,
    on any failure (or Ctrl-C) it is removed and `out` is as it was. A kill leaves only the temp folder,
    which the next export's `clean_leftovers` removes."""
    with staged(out, tmp=_aside(out, "tmp"), aside=_aside(out, "old")) as tmp:
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            raise ConfigError(f"cannot write the export next to {out} ({e.strerror or e}); pass a writable "
                              "folder") from None
        try:
            yield tmp
        except Exception as e:  # disk full, quota, size limit, permissions: one line; the previous export stands
            remove(tmp)  # before the line measures the free space
            if (err := _failed_export(e, out, need_bytes)) is None:
                raise
            raise err from None


def _failed_export(e: Exception, out: Path, need_bytes: int | None) -> Exception | None:
    """The one line of an export that failed writing: a full disk (StorageError) or another OSError
    (ConfigError); None for anything else (raised as it is)."""
    kept = "the previous export is unchanged" if out.exists() else "nothing was written"
    if (err := disk_error(e, out.parent, f"export {out}", needed=need_bytes, after=kept)) is not None:
        return err
    if isinstance(e, OSError):
        return ConfigError(f"cannot write the export {out} ({e.strerror or e}); {kept}")
    return None


# -- token ids: config.json and generation_config.json ------------------------------------------------
def _token_id(vocab: Mapping[str, int], token: Any) -> int | None:
    if isinstance(token, dict):  # tokenizer_config.json's AddedToken form
        token = token.get("content")
    return vocab.get(token) if isinstance(token, str) else None


def _with_eos(eos: Any, train_eos: int | None) -> Any:
    """`eos` (an id or a list of ids, or None) with the id the run trained as end-of-text included."""
    if train_eos is None:
        return eos
    if eos is None:
        return train_eos
    ids = eos if isinstance(eos, list) else [eos]
    return eos if train_eos in ids else [*ids, train_eos]


def special_ids(base_cfg: Mapping[str, Any] | None, tokenizer_dir: Path | None, byte_tokenizer: bool) -> dict:
    """`{"bos_token_id", "eos_token_id", "pad_token_id"}` (those known) for an exported config.json: the
    base model's where it has them, else the tokenizer's; EOS always includes the id the run trained as
    end-of-text and the chat template's end-of-turn tokens (what makes `generate` stop after an answer)."""
    ids: dict[str, Any] = {k: base_cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                           if base_cfg and base_cfg.get(k) is not None}
    train_eos, turn_ends = None, []
    if byte_tokenizer:
        train_eos = ByteTokenizer.eos_id
    elif tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
        tok = HFTokenizer(tokenizer_dir / "tokenizer.json")
        train_eos, vocab = tok.eos_id, tok.tok.get_vocab(with_added_tokens=True)
        tc_path = tokenizer_dir / "tokenizer_config.json"
        try:
            tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{tc_path}: unreadable ({type(e).__name__}: {e})") from None
        tc = tc if isinstance(tc, dict) else {}
        bos = _token_id(vocab, tc.get("bos_token"))
        if bos is None:
            bos = next((vocab[t] for t in BOS_CANDIDATES if t in vocab), None)
        pad = _token_id(vocab, tc.get("pad_token"))
        for k, v in (("bos_token_id", bos), ("pad_token_id", pad)):
            if v is not None:
                ids.setdefault(k, v)
        template = ChatTemplate.from_dir(tokenizer_dir)  # its end-of-turn tokens end an answer too
        turn_ends = [vocab[m] for m in (template.end_markers if template is not None else []) if m in vocab]
    eos = _with_eos(ids.get("eos_token_id"), train_eos)
    for t in turn_ends:  # so transformers' generate stops where shardlm's does, at the end of an answer
        eos = _with_eos(eos, t)
    if eos is not None:
        ids["eos_token_id"] = eos
    return ids


def generation_config(base_dir: Path | None, ids: Mapping[str, Any]) -> dict[str, Any]:
    """The base model's generation_config.json (EOS merged with `ids`'), or one made of `ids`."""
    path = base_dir / GENERATION_CONFIG if base_dir is not None else None
    if path is not None and path.is_file():
        try:
            gen = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
        if isinstance(gen, dict):
            eos = ids.get("eos_token_id")
            for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []):
                gen["eos_token_id"] = _with_eos(gen.get("eos_token_id"), e)
            for k in ("bos_token_id", "pad_token_id"):
                if gen.get(k) is None and ids.get(k) is not None:
                    gen[k] = ids[k]
            return gen
    return dict(ids)


def write_hf_folder(out: str | os.PathLike, shards: list[Iterable[dict[str, torch.Tensor]]],
                    hf_cfg: Mapping[str, Any], tokenizer_dir: str | os.PathLike | None = None,
                    generation: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write `shards` (each an iterable of tensor batches, consumed one shard at a time) as
    `model.safetensors` or `model-0000i-of-0000n.safetensors` + the index, then config.json,
    generation_config.json (when `generation` is given) and the tokenizer files. Existing
    `model*.safetensors` and the index in `out` are replaced. Returns {"files", "weight_map", "total_size"}.
    """
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
        old.unlink(missing_ok=True)  # a previous export's shards would mix in
    weight_map: dict[str, str] = {}
    files, total = [], 0
    for i, batches in enumerate(shards, start=1):
        fname = _shard_name(i, len(shards))
        tensors: dict[str, torch.Tensor] = {}
        for batch in batches:
            tensors.update(batch)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        files.append(fname)
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    if generation is not None:
        (out / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
    _copy_tokenizer(tokenizer_dir, out)
    return {"files": files, "weight_map": weight_map, "total_size": total}


def _check_lora(pairs: LoraPairs, reader: CheckpointReader, expected: Mapping[str, tuple[int, ...]]) -> None:
    for w, ab in pairs.items():
        if w not in expected:
            raise ConfigError(f"{reader.path}: LoRA adapter on {w!r}, which the model does not have")
        a, b = tuple(reader.tensors[ab["A"]].shape), tuple(reader.tensors[ab["B"]].shape)
        *lead, o, i = expected[w]  # lead: (n_experts,) for stacked experts' adapters
        if (len(a) != 2 + len(lead) or len(b) != len(a) or a[:len(lead)] != tuple(lead) or b[:len(lead)] != tuple(lead)
                or a[-1] != i or b[-2] != o or a[-2] != b[-1]):
            raise ConfigError(f"{reader.path}: LoRA shapes A {a}, B {b} do not fit {w!r} of shape {(o, i)}")


def _lora_pairs(reader: CheckpointReader) -> tuple[list[str], dict[str, dict[str, str]]]:
    try:
        base, pairs = split_lora(reader.tensors)
    except ValueError as e:
        raise ConfigError(f"{reader.path}: {e}") from None
    return base, {mod if is_expert_param(mod) else mod + ".weight": ab for mod, ab in pairs.items()}


# -- exports ---------------------------------------------------------------------------------------
@torch.no_grad()
def _plan_files(expected: dict[str, tuple[int, ...]], sources: dict, out_dtype: torch.dtype,
                max_shard_bytes: int) -> list[list[str]]:
    """Our tensor names per output file (`plan_shards`, in natural name order); a fused gate_up_proj is written
    whole, so its up half is planned with its gate half."""
    sizes = {n: math.prod(expected[n]) * out_dtype.itemsize for n in sorted(expected, key=natural_key)}
    for n, src in sources.items():
        if src.dim1 is not None and n.endswith("experts.up_proj"):
            sizes[n.replace("experts.up_proj", "experts.gate_proj")] += sizes.pop(n)
    return plan_shards(sizes, max_shard_bytes)


def export_hf(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    model_cfg: ModelConfig | None = None,
    dtype: str = "bf16",
    max_shard_bytes: int = 2_000_000_000,
    merge_lora: bool = False,
    lora: LoraSection | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    model_type: str | None = None,
    hf_config_overrides: Mapping[str, Any] | None = None,
    generation: Mapping[str, Any] | None = None,
    keep: Iterable[Path | None] = (),
    expert_layout: str = "per-expert",
    log=print,
) -> dict[str, Any]:
    """Write one of our DCP checkpoints as an HF model folder `AutoModelForCausalLM.from_pretrained` reads.

    A mixture of experts is written in `expert_layout`: "per-expert" (the published checkpoints' layout, one
    tensor per expert and projection, which every transformers version loads) or "fused" (newer transformers'
    in-memory `mlp.experts.gate_up_proj` / `down_proj`).

    Offline, one process, no process group. `model_cfg` defaults to the checkpoint's model_config.json.
    Output shards hold at most `max_shard_bytes` (one bigger tensor gets a shard of its own); tensors are
    read from the checkpoint at most READ_BATCH_BYTES at a time, so peak memory is about max_shard_bytes
    (the shard being assembled, in `dtype`) + 256 MB (or the largest tensor, in the checkpoint's dtype).

    LoRA (`X.lora_A.weight`/`X.lora_B.weight` keys): with `merge_lora`, `X.weight += B @ A * alpha/rank`
    (alpha and rank from `lora` or the checkpoint's lora_config.json) and the adapters are dropped;
    without it they are an error (use merge_lora, or export_peft_adapter for the adapters alone).
    `hf_config_overrides` patches config.json (e.g. the base model's `max_position_embeddings`, since
    ours is the training sequence length); `generation` is written as generation_config.json.

    Atomic: every check runs before a weight is written, the folder is written beside `out_dir` and
    swapped in only when complete (a failure or kill leaves a previous export there as it was). `keep`:
    folders `out_dir` must not replace or sit in (the checkpoint and the tokenizer always count).
    Returns {"files", "weight_map", "total_size", "config"}.
    """
    ck = Path(checkpoint_dir)
    out_dtype = _out_dtype(dtype)
    reader = CheckpointReader(ck, STORED_FORMS)
    meta = CheckpointMeta.load(ck)
    cfg = model_cfg or meta.require_model(ck)
    base, pairs = _lora_pairs(reader)
    if pairs and not merge_lora:
        raise ConfigError(f"{ck} holds LoRA adapters ({next(iter(pairs)).removesuffix('.weight')}.lora_A, ...): "
                          "an HF export needs --merge-lora (fold them into the base weights) or --adapter-only "
                          "(a peft adapter)")
    scaling = (lora or meta.require_lora(ck)).scaling if pairs else 0.0
    expected = expected_shapes(cfg)
    try:  # our own checkpoints never duplicate the tied head: tied=False keeps a stray one an error
        validate({n: reader.tensors[n].shape for n in base}, expected, tied=False)
    except ValueError as e:
        raise ConfigError(f"{ck}: {e}") from None
    _check_lora(pairs, reader, expected)

    if expert_layout not in EXPERT_LAYOUTS:
        raise ConfigError(f"expert layout {expert_layout!r} is not one of {', '.join(EXPERT_LAYOUTS)}")
    try:
        hf_cfg = config_to_hf(cfg, model_type)
    except ValueError as e:
        raise ConfigError(f"{ck}: {e}") from None
    sources = hf_sources(cfg, hf_cfg["model_type"], fused=expert_layout == "fused")
    shards = _plan_files(expected, sources, out_dtype, max_shard_bytes)
    hf_cfg["torch_dtype"] = hf_cfg["dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    hf_cfg.update(hf_config_overrides or {})
    tokenizer_files(tokenizer_dir)
    out = Path(out_dir)
    clean_leftovers(out, log)
    check_out_dir(out, keep=[ck, None if tokenizer_dir is None else Path(tokenizer_dir), *keep])
    need = sum(math.prod(v) for v in expected.values()) * out_dtype.itemsize
    check_free_space(out, need)
    with written_aside(out, need) as tmp:
        info = write_hf_folder(tmp, [iter_hf_tensors(reader, s, pairs, scaling, out_dtype, sources=sources)
                                     for s in shards],
                               hf_cfg, tokenizer_dir, generation)
    return {**info, "config": hf_cfg}


@torch.no_grad()
def export_peft_adapter(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    lora: LoraSection | None = None,
    *,
    base_model_name_or_path: str | None = None,
    dtype: str = "fp32",
    log=print,
) -> dict[str, Any]:
    """The LoRA adapters of a checkpoint as a peft folder (`adapter_model.safetensors` + `adapter_config.json`),
    named and configured by shardlm.interop.peft's `to_peft_state_dict` / `peft_adapter_config`.

    `lora` defaults to the checkpoint's lora_config.json; its targets default to the adapted module
    names found in the checkpoint. Adapters are small: they are read in one go. Written atomically,
    like `export_hf`. Returns the adapter config.
    """
    ck, out = Path(checkpoint_dir), Path(out_dir)
    out_dtype = _out_dtype(dtype)
    reader = CheckpointReader(ck, STORED_FORMS)
    _, pairs = _lora_pairs(reader)
    if not pairs:
        raise ConfigError(f"{ck} holds no LoRA adapters (no *.lora_A / *.lora_B tensors)")
    lo = lora or CheckpointMeta.load(ck).require_lora(ck)
    for ab in pairs.values():
        r = reader.tensors[ab["A"]].shape[0]
        if r != lo.rank:
            raise ConfigError(f"{ck}: {ab['A']!r} has rank {r} but the LoRA config says rank {lo.rank}")
    names = sorted((n for ab in pairs.values() for n in ab.values()), key=natural_key)
    try:
        sd = to_peft_state_dict(reader.read(names))
    except ValueError as e:
        raise ConfigError(f"{ck}: {e}") from None
    sd = {k: v.to(out_dtype).contiguous() for k, v in sd.items()}
    targets = lo.targets or sorted({w.removesuffix(".weight").rsplit(".", 1)[-1] for w in pairs})
    config = peft_adapter_config(lo.rank, lo.alpha, lo.dropout, targets,
                                 base_model_name_or_path=base_model_name_or_path or "")
    from safetensors.torch import save_file

    clean_leftovers(out, log)
    check_out_dir(out, keep=[ck])
    need = sum(t.numel() * t.element_size() for t in sd.values())
    check_free_space(out, need)
    with written_aside(out, need) as tmp:
        save_file(sd, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def recorded_tokenizer(ck: Path, meta: CheckpointMeta) -> str | None:
    """The tokenizer the run trained with: hf_source.json's, else checkpoint.json's ("bytes" or a path)."""
    if meta.tokenizer is not None:
        return meta.tokenizer
    rec = Record.read(ck)
    tok = rec.facts.tokenizer if rec is not None else None
    spec = tok.get("spec") if tok is not None else None
    return spec if isinstance(spec, str) and spec else None


def export_checkpoint(checkpoint_dir: str | os.PathLike, out: str | os.PathLike, *, merge_lora: bool = False,
                      adapter_only: bool = False, dtype: str = "bf16",
                      tokenizer_dir: str | os.PathLike | None = None, expert_layout: str = "per-expert",
                      log=print) -> dict[str, Any]:
    """`shardlm convert dcp-to-hf`: a checkpoint folder exported on its own, from its sidecar files.

    adapter_only: a peft adapter (its base named from the checkpoint's HF source). Otherwise an HF
    folder: refused for an adapters-only checkpoint (it has no base weights), with the base model's
    `max_position_embeddings` (ours is the training sequence length), BOS/EOS/PAD ids in config.json
    and generation_config.json (the base's where it has them, else the tokenizer's; EOS always holds the
    id the run trained as end-of-text), and the tokenizer files of `tokenizer_dir` or of the tokenizer
    the run trained with (none for the byte tokenizer). Returns {"kind": "peft"|"hf", "tokenizer", ...}.
    """
    ck = Path(checkpoint_dir)
    clean_leftovers(Path(out), log)  # first: a previous export a kill left aside is put back even if we fail
    if (err := not_a_checkpoint(ck)) is not None:  # a command-line argument that names no checkpoint
        raise err
    if tokenizer_dir is not None and not Path(tokenizer_dir).exists():
        raise ConfigError(f"--tokenizer {tokenizer_dir}: no such file or folder")
    meta = CheckpointMeta.load(ck)
    if merge_lora and adapter_only:
        raise ConfigError("--merge-lora and --adapter-only ask for opposite exports: the adapters folded into the "
                          "weights (an HF model) or the adapters alone (a peft folder); pass one")
    if (merge_lora or adapter_only) and meta.lora is None:
        flag = "--merge-lora" if merge_lora else "--adapter-only"
        raise ConfigError(f"{flag}: {ck} holds no LoRA adapters (a full fine-tune or pre-training run); drop the flag "
                          "to export its weights")
    if adapter_only:
        base = str(meta.hf_dir) if meta.hf_dir is not None else None
        return {"kind": "peft", "config": export_peft_adapter(ck, out, dtype="fp32", base_model_name_or_path=base,
                                                             log=log)}
    if meta.lora is not None and meta.lora.adapters_only:
        raise ConfigError(f"{ck} holds LoRA adapters only (lora.adapters_only): export them with --adapter-only "
                          "and load them on the base model with peft")
    base_dir = meta.hf_dir if meta.hf_dir is not None and meta.hf_dir.is_dir() else None
    base_cfg = None
    if base_dir is not None and (base_dir / "config.json").is_file():
        try:
            base_cfg = json.loads((base_dir / "config.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{base_dir / 'config.json'}: unreadable ({type(e).__name__}: {e})") from None
        base_cfg = base_cfg if isinstance(base_cfg, dict) else None
    overrides: dict[str, Any] = {}
    if base_cfg and "max_position_embeddings" in base_cfg:  # keep the base's context length, not our seq_len
        overrides["max_position_embeddings"] = base_cfg["max_position_embeddings"]
    if tokenizer_dir is not None:
        spec: str | None = str(tokenizer_dir)
    else:
        spec = recorded_tokenizer(ck, meta)
        if spec not in (None, "bytes") and not Path(spec).exists():
            raise ConfigError(f"{ck} was trained with the tokenizer {spec}, which is not there any more; pass its "
                              "folder with --tokenizer DIR")
    byte_tokenizer = spec == "bytes"
    tok = tokenizer_dir_of(spec)
    ids = special_ids(base_cfg, tok, byte_tokenizer)
    overrides.update(ids)
    gen = generation_config(base_dir, ids) if ids or base_dir is not None else None
    if merge_lora and meta.lora is not None and meta.lora.base_dtype == "nf4":
        log(f"shardlm: warning: {ck} is a QLoRA run (lora.base_dtype=nf4): the adapters are merged into the "
            "NF4-quantised base they were trained against (dequantised, as saved), not the original weights")
    info = export_hf(ck, out, dtype=dtype, merge_lora=merge_lora, tokenizer_dir=tok,
                     hf_config_overrides=overrides or None, generation=gen, keep=[base_dir],
                     expert_layout=expert_layout, log=log)
    return {"kind": "hf", "tokenizer": "bytes" if byte_tokenizer else tok, "generation": gen is not None, **info}
