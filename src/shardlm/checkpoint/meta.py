"""The files a checkpoint carries beside DCP's tensors: what it takes to export it on its own.

One owner for the sidecar schema. `CheckpointMeta.save(dir)` writes, `CheckpointMeta.load(dir)` reads:

  model_config.json  `dataclasses.asdict(ModelConfig)` (always written)
  lora_config.json   {"rank", "alpha", "dropout", "targets", "adapters_only", "train_embeddings", "train_norms",
                     "base_dtype" (only when not auto), "base"} when LoRA is on ("base" is model.init_from
                     again; the reader takes it only when hf_source.json is absent)
  hf_source.json     {"init_from": "hf:/path", "tokenizer": spec} when the model came from an HF folder
  checkpoint.json    lineage and run facts (checkpoint/lineage.py owns it)

Paths are recorded absolute (from this version on), so a checkpoint reads the same from any working
directory; a relative one (older versions) is resolved by `resolve_recorded` when read.

A file that is absent reads as "not recorded" (None); a file that is present but malformed is a
CheckpointError naming the file.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from shardlm.config import Config, LoraSection
from shardlm.data.tokenizer import canonical_spec
from shardlm.errors import CheckpointError
from shardlm.models.llama import ModelConfig, RopeScaling

MODEL_CONFIG_FILE = "model_config.json"
LORA_CONFIG_FILE = "lora_config.json"
HF_SOURCE_FILE = "hf_source.json"
HF_PREFIX = "hf:"


def model_config_from_dict(d: Mapping[str, Any]) -> ModelConfig:
    """The inverse of `dataclasses.asdict(ModelConfig)` (rebuilds RopeScaling); ValueError on bad fields."""
    if not isinstance(d, Mapping):
        raise ValueError(f"expected a JSON object, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}")
    kw = dict(d)
    if kw.get("rope_scaling") is not None:
        try:
            kw["rope_scaling"] = RopeScaling(**kw["rope_scaling"])
        except TypeError as e:
            raise ValueError(f"bad rope_scaling {kw['rope_scaling']!r} ({e})") from None
    try:
        return ModelConfig(**kw)
    except TypeError as e:
        raise ValueError(str(e)) from None


def _lora_from_dict(d: Mapping[str, Any]) -> LoraSection:
    if not isinstance(d, Mapping):
        raise ValueError(f"expected a JSON object, got {type(d).__name__}")
    rank, alpha = d.get("rank"), d.get("alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"'rank' must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"'alpha' must be a number, got {alpha!r}")
    dropout = d.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise ValueError(f"'dropout' must be a number, got {dropout!r}")
    targets = d.get("targets", [])  # [] = not recorded: the exporter takes the adapted modules it finds
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"'targets' must be a list of module names, got {targets!r}")
    return LoraSection(rank=rank, alpha=float(alpha), dropout=float(dropout), targets=list(targets),
                       adapters_only=bool(d.get("adapters_only", False)),
                       train_embeddings=bool(d.get("train_embeddings", False)),
                       train_norms=bool(d.get("train_norms", False)),
                       base_dtype=_base_dtype(d.get("base_dtype", "auto")))


def _base_dtype(v: Any) -> str:
    if v not in ("auto", "bf16", "fp32", "nf4"):
        raise ValueError(f"'base_dtype' must be auto, bf16, fp32 or nf4, got {v!r}")
    return v


def tokenizer_dir_of(spec: str | None) -> Path | None:
    """The folder holding a tokenizer's files: the spec itself if a folder, else the file's folder;
    None for the byte tokenizer (or none recorded)."""
    if spec in (None, "", "bytes"):
        return None
    p = Path(spec)
    return p if p.is_dir() else p.parent


def resolve_recorded(path: str, checkpoint: Path) -> str:
    """A path recorded in `checkpoint`, absolute. Older versions recorded paths as given (relative to the
    working directory of the run): such a path is tried against this working directory, then against the
    folders above the checkpoint (the run folder and its parents, one of which the run started in); the
    first that exists wins, else it is returned resolved against this working directory."""
    p = Path(path)
    if p.is_absolute() or path in ("", "bytes"):
        return path
    for base in (Path.cwd(), *checkpoint.resolve().parents):
        if (base / p).exists():
            return str((base / p).resolve())
    return str(p.resolve())


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint holds besides tensors. `model` is None for a checkpoint without model_config.json."""

    model: ModelConfig | None
    lora: LoraSection | None = None
    init_from: str = ""  # model.init_from: "hf:/path" or "" (random init)
    tokenizer: str | None = None  # the resolved tokenizer spec ("bytes", a tokenizer.json or its folder)
    # The lora_config.json keys the file had (older files lack train_embeddings/train_norms): the resume
    # check compares only what was recorded.
    lora_recorded: frozenset[str] = dataclasses.field(default=frozenset(), compare=False)

    @classmethod
    def from_config(cls, cfg: Config, model_cfg: ModelConfig, tokenizer_spec: str) -> CheckpointMeta:
        """The sidecar of a run of `cfg`; `tokenizer_spec`: the run's resolved tokenizer
        (`shardlm.resolve.tokenizer_spec`)."""
        hf = cfg.model.hf_dir
        return cls(model=model_cfg, lora=dataclasses.replace(cfg.lora) if cfg.lora.rank > 0 else None,
                   init_from=f"{HF_PREFIX}{hf.resolve()}" if hf is not None else "",
                   tokenizer=canonical_spec(tokenizer_spec) if hf is not None else None)

    # -- derived -----------------------------------------------------------------------------------
    @property
    def hf_dir(self) -> Path | None:
        """The HF folder the model was initialised from (`hf:/path`), or None."""
        return Path(self.init_from[len(HF_PREFIX):]) if self.init_from.startswith(HF_PREFIX) else None

    @property
    def tokenizer_dir(self) -> Path | None:
        """The folder holding the tokenizer files, or None for the byte tokenizer (or none recorded)."""
        return tokenizer_dir_of(self.tokenizer)

    @property
    def lora_scaling(self) -> float:
        """alpha / rank (0.0 without LoRA)."""
        return self.lora.scaling if self.lora is not None else 0.0

    # -- files -------------------------------------------------------------------------------------
    def files(self) -> dict[str, str]:
        """File name -> text, exactly what `save` writes."""
        out = {}
        if self.model is not None:
            out[MODEL_CONFIG_FILE] = json.dumps(dataclasses.asdict(self.model), indent=1)
        lo = self.lora
        if lo is not None:
            d = {"rank": lo.rank, "alpha": lo.alpha, "dropout": lo.dropout, "targets": lo.targets,
                 "adapters_only": lo.adapters_only, "train_embeddings": lo.train_embeddings,
                 "train_norms": lo.train_norms, "base": self.init_from}
            if lo.base_dtype != "auto":  # absent = auto: the files of the default setup stay as they were
                d["base_dtype"] = lo.base_dtype
            out[LORA_CONFIG_FILE] = json.dumps(d, indent=1)
        if self.hf_dir is not None:
            out[HF_SOURCE_FILE] = json.dumps({"init_from": self.init_from, "tokenizer": self.tokenizer}, indent=1)
        return out

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        for name, text in self.files().items():
            (d / name).write_text(text)

    @classmethod
    def load(cls, directory: str | Path) -> CheckpointMeta:
        """The sidecar files of a checkpoint folder; absent ones read as not recorded."""
        d = Path(directory)
        model = lora = None
        init_from, tokenizer, source, recorded = "", None, d, frozenset()
        path = d / MODEL_CONFIG_FILE
        if path.is_file():
            try:
                model = model_config_from_dict(_read_json(path))
            except ValueError as e:
                raise CheckpointError(f"{path}: {e}") from None
        path = d / LORA_CONFIG_FILE
        if path.is_file():
            raw = _read_json(path)
            try:
                lora = _lora_from_dict(raw)
            except ValueError as e:
                raise CheckpointError(f"{path}: {e}") from None
            init_from, source, recorded = raw.get("base") or "", path, frozenset(raw)
        path = d / HF_SOURCE_FILE
        if path.is_file():
            raw = _read_json(path)
            if not isinstance(raw, dict) or not isinstance(raw.get("init_from", ""), str) \
                    or not isinstance(raw.get("tokenizer"), (str, type(None))):
                raise CheckpointError(f"{path}: expected {{\"init_from\": \"hf:/path\", \"tokenizer\": spec}}, "
                                      f"got {raw!r}")
            init_from, tokenizer, source = raw.get("init_from", ""), raw.get("tokenizer"), path
        if not isinstance(init_from, str) or (init_from and not init_from.startswith(HF_PREFIX)):
            raise CheckpointError(f"{source}: init_from {init_from!r} is not an hf:/path")
        if init_from:
            init_from = HF_PREFIX + resolve_recorded(init_from[len(HF_PREFIX):], d)
        if tokenizer is not None:
            tokenizer = resolve_recorded(tokenizer, d)
        return cls(model=model, lora=lora, init_from=init_from, tokenizer=tokenizer, lora_recorded=recorded)

    def require_model(self, where: str | Path) -> ModelConfig:
        """`model`, or a CheckpointError saying the checkpoint does not record it."""
        if self.model is None:
            raise CheckpointError(f"{where} has no {MODEL_CONFIG_FILE}; pass the model config (preset and "
                                  "overrides the checkpoint was trained with)")
        return self.model

    def require_lora(self, where: str | Path) -> LoraSection:
        """`lora`, or a CheckpointError saying the checkpoint holds adapters without their config."""
        if self.lora is None:
            raise CheckpointError(f"{where} holds LoRA adapters but no {LORA_CONFIG_FILE}; pass the LoRA rank "
                                  "and alpha")
        return self.lora


# -- the resume check ------------------------------------------------------------------------------
_LORA_FIELDS = ("rank", "alpha", "dropout", "targets", "adapters_only", "train_embeddings", "train_norms",
                "base_dtype")
#: Names `checkpoint.allow_changed` accepts: what `resume_changes` can report.
CHANGEABLE = tuple(f"model.{f.name}" for f in dataclasses.fields(ModelConfig) if f.name != "max_seq_len") + \
    tuple(f"lora.{f}" for f in _LORA_FIELDS) + ("tokenizer", "data")


def data_changes(saved: list | None, run: list | None) -> tuple[str, str] | None:
    """(checkpoint's, this run's) description of the training data where the sources' content differs, or
    None. Each side is `run_info()["data"]`: per source (in order) its config path, documents, tokens and
    content sha256. A checkpoint that recorded none (older versions) is not compared."""
    if not isinstance(saved, list) or not isinstance(run, list):
        return None

    def describe(d: dict) -> str:
        return (f"{d.get('source')}: {d.get('documents', 0):,} documents, {d.get('tokens', 0):,} tokens, "
                f"sha256 {d.get('sha256')}")

    keys = ("source", "documents", "tokens", "sha256")
    if len(saved) != len(run):
        return (f"{len(saved)} source(s) [{'; '.join(describe(d) for d in saved)}]",
                f"{len(run)} [{'; '.join(describe(d) for d in run)}]")
    diff = [i for i, (a, b) in enumerate(zip(saved, run))
            if not isinstance(a, dict) or any(a.get(k) != b.get(k) for k in keys)]
    if not diff:
        return None
    which = (lambda i: f"source {i + 1} ") if len(run) > 1 else (lambda i: "")
    return ("; ".join(which(i) + (describe(saved[i]) if isinstance(saved[i], dict) else "?") for i in diff),
            "; ".join(which(i) + describe(run[i]) for i in diff))


def resume_changes(saved: CheckpointMeta, run: CheckpointMeta) -> dict[str, tuple[Any, Any]]:
    """`{field: (checkpoint's value, this run's)}` for every recorded model / LoRA field that differs.

    `model.max_seq_len` is not compared: it is the RoPE table length, which follows data.seq_len.
    A checkpoint without model_config.json (written by hand or by an old version) records nothing.
    """
    if saved.model is None or run.model is None:
        return {}
    out: dict[str, tuple[Any, Any]] = {}
    a, b = dataclasses.asdict(saved.model), dataclasses.asdict(run.model)
    for k in a:
        if k != "max_seq_len" and a[k] != b[k]:
            out[f"model.{k}"] = (a[k], b[k])
    sl, rl = saved.lora, run.lora
    if (sl is None) != (rl is None):
        out["lora.rank"] = (sl.rank if sl else 0, rl.rank if rl else 0)
    elif sl is not None and rl is not None:
        for k in _LORA_FIELDS:
            if saved.lora_recorded and k not in saved.lora_recorded and k != "base_dtype":
                continue  # an older lora_config.json: not recorded, not compared (base_dtype: absent = auto)
            x, y = getattr(sl, k), getattr(rl, k)
            if k == "targets":
                if not x:  # [] = not recorded
                    continue
                x, y = sorted(x), sorted(y)
            if x != y:
                out[f"lora.{k}"] = (x, y)
    return out
