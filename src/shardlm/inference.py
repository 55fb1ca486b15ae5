"""A model to run, not to train: from an HF folder or a DCP checkpoint, in one process or sharded.

    inf = load_for_inference(hf="/models/qwen3")          # or checkpoint="runs/x/checkpoints/step-200"
    ids = inf.encode("Why is the sky blue?")                # the chat template when the tokenizer has one
    [c] = generate_batch(inf.model, [ids], 64, stop_ids=inf.stop_ids, context=inf.context)
    inf.close()

Where it runs: a plain process (no torchrun) gets a plain model on one device (CUDA when there is one,
`train.device` to choose), no process group, in `train.mixed_precision` (auto: bf16 on GPUs, fp32 on
CPU). Under torchrun it joins the process group (`shardlm.distributed`), builds the `parallel.*` mesh
and takes THE build path (`build.build_model`: meta -> fully_shard -> materialise), so each rank reads
only its own shards; the sharded weights stay fp32 and FSDP computes in the precision's dtype. Every
rank must then run the same calls (generate_batch does the lockstep).

What it reads:
  hf=DIR          config.json + safetensors (`interop.hf.load`), the folder's tokenizer.json.
  checkpoint=DIR  a step-N DCP checkpoint: model-only or full (only `model.*` is read), or the output of
                  `shardlm convert hf-to-dcp`. LoRA adapters in it are merged on the fly: each rank reads
                  the base rows it owns and the adapters whole (small), and adds B @ A * alpha/r to its rows,
                  in fp32, the arithmetic of `convert dcp-to-hf --merge-lora`. An adapters-only checkpoint
                  takes its base from the HF folder it records. The tokenizer is the one the run trained
                  with (as recorded in the checkpoint).
Context (`Inference.context`, RoPE table length): the HF folder's max_position_embeddings; for a checkpoint,
its HF base's when it records one, else the sequence length it was trained at. Generation stops there (prompt
+ new tokens <= context; `generate.check_context` words the warning).
Stop ids: the tokenizer's end-of-text id, the EOS ids of the model folder's generation_config.json (else
config.json), and the chat template's end-of-turn tokens (`<|im_end|>`, `<|eot_id|>`, ...) in the vocab.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardlm.build import STORED_FORMS, build_model, build_model_config, materialize_weights, model_state_bytes
from shardlm.checkpoint.manager import SafeLoadPlanner, read_keys, saved_tensors
from shardlm.checkpoint.meta import CheckpointMeta
from shardlm.checkpoint.reader import CheckpointReader, SINGLE_PROCESS_WARNING
from shardlm.config import Config, LoraSection
from shardlm.data.tokenizer import Tokenizer, load_tokenizer
from shardlm.distributed.env import device_type, shutdown_distributed
from shardlm.errors import CheckpointError, ConfigError
from shardlm.lora import lora_delta
from shardlm.models.llama import ModelConfig, Transformer
from shardlm.models.moe import is_expert_param
from shardlm.parallel.launch import plan_launch
from shardlm.data.sft import ChatTemplate
from shardlm.generate import encode_prompt
from shardlm.interop.hf.config import read_hf_config
from shardlm.interop.hf.export import recorded_tokenizer
from shardlm.interop.hf.load import load_hf_weights
from shardlm.interop.hf.names import split_lora
from shardlm.parallel.fsdp import shard_region

Pairs = dict[str, dict[str, str]]  # adapted module -> {"A": its lora_A name, "B": its lora_B name}


@dataclass
class Inference:
    """What `load_for_inference` returns: the model in eval mode and everything needed to prompt it."""

    model: Transformer
    tokenizer: Tokenizer
    config: Config  # resolved: model.init_from, data.tokenizer and data.seq_len (= context) set
    model_cfg: ModelConfig
    device: torch.device
    precision: str  # "fp32" | "bf16": the compute dtype
    context: int  # the most tokens a row may reach, prompt + new (the RoPE table)
    stop_ids: tuple[int, ...]
    template: Any  # the tokenizer folder's ChatTemplate, or None
    source: str  # "hf:/dir" or "checkpoint:/dir", plus what was merged
    rank: int = 0
    world_size: int = 1
    owns_process_group: bool = False

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def encode(self, prompt: str | list[dict[str, str]], chat: bool = True) -> list[int]:
        """A prompt's ids (`generate.encode_prompt`), through the chat template when there is one and `chat`."""
        return encode_prompt(self.tokenizer, prompt, self.template if chat else None)

    def describe(self) -> str:
        """One line: source, size, ranks, device and precision, tokenizer, template, stop ids, context."""
        n = self.model_cfg.num_params()
        where = f"{self.world_size} ranks (FSDP)" if self.world_size > 1 or self.owns_process_group else "1 process"
        tok = self.config.data.tokenizer
        return (f"{self.source}: {n / 1e6:.2f}M params on {where}, {self.device.type} {self.precision}; tokenizer "
                f"{tok} ({self.tokenizer.vocab_size} ids){', chat template' if self.template is not None else ''}; "
                f"stop ids {list(self.stop_ids)}; context {self.context}")

    def close(self) -> None:
        """Drop the model and, when this call made it, the process group (`shutdown_distributed`)."""
        self.model = None  # type: ignore[assignment]
        if self.owns_process_group:
            shutdown_distributed()
            self.owns_process_group = False


# -- what the source holds -------------------------------------------------------------------------
def _declared_eos(folder: Path | None) -> list[int]:
    """The EOS id(s) an HF folder declares: generation_config.json's, else config.json's."""
    for name in ("generation_config.json", "config.json"):
        path = folder / name if folder is not None else None
        if path is None or not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if value is not None:
            return [int(v) for v in (value if isinstance(value, list) else [value])]
    return []


def _stop_ids(tokenizer: Tokenizer, folder: Path | None, template: Any) -> tuple[int, ...]:
    ids = [tokenizer.eos_id, *_declared_eos(folder)]
    hf = getattr(tokenizer, "tok", None)
    for marker in getattr(template, "end_markers", []):
        i = hf.token_to_id(marker) if hf is not None else None
        if i is not None:
            ids.append(i)
    return tuple(dict.fromkeys(ids))


def _checkpoint_tokenizer(ck: Path, meta: CheckpointMeta) -> str:
    spec = recorded_tokenizer(ck, meta)
    if spec is None:
        raise ConfigError(f"{ck} records no tokenizer; pass one with --tokenizer (a tokenizer.json, its folder, "
                          "or bytes)")
    if spec != "bytes" and not Path(spec).exists():
        raise ConfigError(f"{ck} was trained with the tokenizer {spec}, which is not there any more; pass its "
                          "folder with --tokenizer")
    return spec


def _adapters(ck: Path, meta: CheckpointMeta) -> tuple[Pairs, float]:
    """The checkpoint's LoRA pairs and alpha / rank (({}, 0.0) without adapters)."""
    stored = [k[len("model."):] for k in read_keys(ck) if k.startswith("model.")]
    try:
        _, pairs = split_lora(stored)
    except ValueError as e:
        raise CheckpointError(f"{ck}: {e}; the checkpoint is damaged") from None
    if not pairs:
        return {}, 0.0
    lo = meta.require_lora(ck)
    return pairs, lo.scaling


# -- loading ---------------------------------------------------------------------------------------
@torch.no_grad()
def load_merged_lora(model: Transformer, ck: Path, pairs: Pairs, scaling: float, base: bool) -> None:
    """Fill `model` (plain or sharded, no LoRA modules) from checkpoint `ck`, adding each adapter's
    B @ A * scaling to its base weight: every rank reads only its rows of the base (`base`: they are in the
    checkpoint; else already loaded) and the adapters whole."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict


    stored = saved_tensors(ck, "model")
    state = get_model_state_dict(model) if base else {}
    missing = sorted(state.keys() - stored.keys())
    if missing:  # a QLoRA run's base weights are stored as NF4 pieces: read each dequantised, keep this rank's rows
        reader = CheckpointReader(ck, STORED_FORMS)
        for name in [n for n in missing if n in reader.encoded]:
            local, shape, offset = shard_region(model.get_parameter(name))
            if local.numel():
                full = reader.read([name])[name]
                local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))].to(local.dtype))
                del full
        encoded = set(reader.encoded)
        state, missing = ({k: v for k, v in state.items() if k not in encoded},
                          [n for n in missing if n not in encoded])
    if missing:
        raise CheckpointError(f"{ck} lacks {len(missing)} weight(s) this model needs ({', '.join(missing[:3])}"
                              f"{', ...' if len(missing) > 3 else ''}); pass a checkpoint of this model")
    factors = {n: torch.empty(stored[n][0], dtype=stored[n][1]) for ab in pairs.values() for n in ab.values()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        dcp_load({"model": {**state, **factors}}, checkpoint_id=str(ck), planner=SafeLoadPlanner())
    if state:
        set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    for module, ab in pairs.items():
        try:  # a stacked experts' projection is its own parameter (no `.weight`)
            weight = model.get_parameter(module if is_expert_param(module) else f"{module}.weight")
        except AttributeError:
            raise CheckpointError(f"{ck}: LoRA adapter {module!r} has no base weight in this model; pass a "
                                  "checkpoint of this model") from None
        local, shape, offset = shard_region(weight)
        if local.numel() == 0:
            continue
        rows = slice(offset[0], offset[0] + shape[0])
        a = factors[ab["A"]]
        a = a[rows] if a.dim() == 3 else a  # stacked experts: the rows are experts, in both factors
        delta = lora_delta(a, factors[ab["B"]][rows], scaling)
        delta = delta[(slice(None), *(slice(o, o + n) for o, n in zip(offset[1:], shape[1:])))]  # dim-1 shards
        local.copy_((local.float() + delta).to(local.dtype))


def _materializer(ck: Path | None, pairs: Pairs, scaling: float, adapters_only: bool, base_dir: Path | None):
    """build_model's `materialize` step for this source (build.materialize_weights where no LoRA is merged)."""
    def materialize(model: Transformer, cfg: Config, device: torch.device) -> None:
        if ck is None or not pairs:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
                materialize_weights(model, cfg, device)
            return
        model.to_empty(device=device)
        model.rope.reset_parameters()
        if adapters_only:
            load_hf_weights(model, base_dir)
        load_merged_lora(model, ck, pairs, scaling, base=not adapters_only)

    return materialize


def load_for_inference(*, hf: str | os.PathLike | None = None, checkpoint: str | os.PathLike | None = None,
                       cfg: Config | None = None, tokenizer: str | None = None) -> Inference:
    """The model of an HF folder (`hf`) or a DCP checkpoint (`checkpoint`), ready to decode (see the module
    docstring). `cfg` supplies train.device, train.mixed_precision, data.tokenizer and parallel.* (default:
    the defaults); its model and LoRA sections are ignored. `tokenizer` overrides the tokenizer (a
    tokenizer.json, its folder, or "bytes"). ConfigError / CheckpointError name what is wrong and the fix.
    """
    if (hf is None) == (checkpoint is None):
        raise ConfigError("load_for_inference needs an HF folder or a checkpoint (exactly one of them)")
    cfg = copy.deepcopy(cfg) if cfg is not None else Config()
    cfg.lora = LoraSection()  # a checkpoint's adapters are merged into the weights, not applied as modules
    cfg.train.ac, cfg.train.compile, cfg.train.cpu_offload = "none", False, False
    if cfg.train.mixed_precision == "fp8":
        raise ConfigError("generation runs in bf16 or fp32: drop train.mixed_precision=fp8 (or set it to auto)")
    if cfg.parallel.cp != 1:  # not dropped quietly: the mesh degrees given with it would no longer multiply up
        raise ConfigError(f"parallel.cp={cfg.parallel.cp} is a training layout: generation and evaluation run whole "
                          "sequences (with a KV cache) on every rank; drop parallel.cp (and set parallel.dp_shard "
                          "to fill the ranks, e.g. -1)")
    tokenizer = tokenizer or (cfg.data.tokenizer if cfg.data.tokenizer != "auto" else None)
    ck, pairs, scaling, adapters_only = None, {}, 0.0, False
    if hf is not None:
        folder = Path(hf).resolve()
        context = read_hf_config(folder)[0].max_seq_len  # ConfigError for a folder that is not an HF model
        if tokenizer is None and not (folder / "tokenizer.json").is_file():
            raise ConfigError(f"{folder} has no tokenizer.json; pass one with --tokenizer (a tokenizer.json, its "
                              "folder, or bytes)")
        cfg.model.init_from, base_dir, source = f"hf:{folder}", folder, f"hf:{folder}"
        spec = tokenizer or str(folder)
    else:
        ck = Path(checkpoint).resolve()
        read_keys(ck)  # CheckpointError unless a complete checkpoint
        meta = CheckpointMeta.load(ck)
        mc = meta.require_model(ck)
        pairs, scaling = _adapters(ck, meta)
        adapters_only = bool(pairs) and meta.lora is not None and meta.lora.adapters_only
        base_dir = meta.hf_dir
        if adapters_only and (base_dir is None or not base_dir.is_dir()):
            raise CheckpointError(f"{ck} holds LoRA adapters only and its base model "
                                  f"{base_dir or '(not recorded)'} is not there; put the base back at that path")
        context = mc.max_seq_len
        if base_dir is not None and (base_dir / "config.json").is_file():
            context = read_hf_config(base_dir)[0].max_seq_len
        cfg.model.init_from = f"dcp:{ck}"
        merged = f" (LoRA r={meta.lora.rank} merged)" if pairs else ""
        source = f"checkpoint:{ck}{merged}"
        spec = tokenizer or _checkpoint_tokenizer(ck, meta)
    cfg.data.tokenizer, cfg.data.seq_len = spec, context
    tok = load_tokenizer(spec)
    model_cfg = build_model_config(cfg, tok.vocab_size)
    materialize = _materializer(ck, pairs, scaling, adapters_only, base_dir)
    model, device, rank, world, owns = _build(cfg, model_cfg, materialize)
    template = ChatTemplate.from_dir(getattr(tok, "directory", None))
    return Inference(model=model.eval(), tokenizer=tok, config=cfg, model_cfg=model_cfg, device=device,
                     precision=cfg.train.precision(device.type), context=context,
                     stop_ids=_stop_ids(tok, base_dir, template), template=template, source=source, rank=rank,
                     world_size=world, owns_process_group=owns)


def _build(cfg: Config, mc: ModelConfig, materialize) -> tuple[Transformer, torch.device, int, int, bool]:
    """(model, device, rank, world size, whether a process group was made here); through build.build_model."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: sharded, every rank its own shards
        plan = plan_launch(cfg.parallel, cfg.train.device, functools.partial(model_state_bytes, cfg, mc))
        owns = not dist.is_initialized()
        env = plan.start()
        try:
            model = build_model(cfg, mc, plan.build_mesh(env), env.device, materialize=materialize)
        except BaseException:
            if owns:
                shutdown_distributed()
            raise
        return model, env.device, env.rank, env.world_size, owns
    kind = device_type(cfg.train.device)
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    return build_model(cfg, mc, None, device, materialize=materialize), device, 0, 1, False


__all__ = ["Inference", "load_for_inference", "load_merged_lora"]
