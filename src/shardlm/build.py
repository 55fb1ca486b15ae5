"""THE model recipe. Trainer, planner and inference (generate, eval) build a model only through here.

    meta -> LoRA / freeze (the frozen base stored as lora.base_dtype: bf16, fp32 or NF4) -> float8 linears
         -> activation checkpointing -> compile -> fully_shard -> materialise -> init or HF load

`materialize` is the one step a caller may swap: the trainer allocates real storage and fills it
(each rank only its shards: `init_weights` draws shard-invariant numbers, the HF load reads only
the rows a rank owns); the planner allocates fake storage (FakeTensorMode) and fills nothing.
Inference in one plain process passes no mesh: no fully_shard, the weights cast to the compute dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh

from shardlm.checkpoint.init import dcp_model_config, load_dcp_weights
from shardlm.config import Config
from shardlm.errors import ConfigError
from shardlm.interop.hf.config import read_hf_config
from shardlm.interop.hf.load import load_hf_weights
from shardlm.lora import apply_lora, cast_frozen, is_lora_param, nf4_targets
from shardlm.models import ModelConfig, Transformer, get_preset
from shardlm.parallel.ac import apply_ac
from shardlm.parallel.compile import apply_compile
from shardlm.parallel.cp import apply_context_parallel, check_cp
from shardlm.parallel.dims import cp_size, fsdp_mesh
from shardlm.parallel.fsdp import apply_fsdp, mp_policy, shard_view
from shardlm.quant.fp8 import apply_fp8, check_fp8_hardware
from shardlm.quant.nf4 import NF4_FORM, apply_nf4, check_shapes, is_nf4, nf4_nbytes, nf4_params, quantize_into
from shardlm.resolve import base_dtype, frozen_dtype, uses_fp8_all_gather

Materialize = Callable[[Transformer, Config, torch.device], None]
TRAINING_FIELDS = ("router_aux_loss_coef", "router_z_loss_coef")  # model.* fields that leave the shape alone
# The stored forms (shardlm.checkpoint.stored) the parameters this recipe makes may be held in: the checkpoint
# code is told, it knows no encoding. Hand these to Checkpointer, CheckpointReader and load_dcp_weights.
STORED_FORMS = (NF4_FORM,)


def build_model_config(cfg: Config, tokenizer_vocab: int, warn: Callable[[str], None] | None = None) -> ModelConfig:
    """The preset (or the HF folder's config.json), with any model.* overrides, RoPE sized to data.seq_len.

    `warn` gets one line for what is allowed but likely a mistake: a data.seq_len beyond the context a
    pretrained model (model.init_from) was trained for.
    """
    overrides = {k: v for k, v in dataclasses.asdict(cfg.model).items()
                 if k not in ("preset", "init_from") and v is not None}
    training = {k: overrides.pop(k) for k in TRAINING_FIELDS if k in overrides}  # not the shape: any source
    if cfg.model.init_from and overrides:
        raise ConfigError(f"model.{next(iter(overrides))} cannot change the shape of a model loaded with "
                          "model.init_from; drop the override")
    if cfg.model.hf_dir is not None:
        base, _ = read_hf_config(cfg.model.hf_dir)
    elif cfg.model.dcp_dir is not None:
        base = dcp_model_config(cfg.model.dcp_dir)
    else:
        try:
            base = get_preset(cfg.model.preset)
        except KeyError as e:
            raise ConfigError(f"model.preset: {e.args[0]}") from None
    if warn is not None and cfg.model.init_from and cfg.data.seq_len > base.max_seq_len:
        where = (f"max_position_embeddings={base.max_seq_len} in {cfg.model.hf_dir / 'config.json'}"
                 if cfg.model.hf_dir is not None else f"the checkpoint's max_seq_len={base.max_seq_len}")
        warn(f"shardlm: warning: data.seq_len={cfg.data.seq_len} is beyond {where}: positions past "
             f"{base.max_seq_len} were never trained (RoPE extrapolates); lower data.seq_len or expect a worse start")
    if ({"dim", "n_heads"} & overrides.keys()) and base.head_dim == base.dim // base.n_heads:
        overrides["head_dim"] = None  # derived, not set by the preset: derive it again (Qwen3's stays)
    if "n_heads" in overrides and "n_kv_heads" not in overrides and base.n_kv_heads == base.n_heads:
        overrides["n_kv_heads"] = None  # plain MHA stays MHA
    try:
        mc = dataclasses.replace(base, **overrides, **training, max_seq_len=cfg.data.seq_len)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    if not mc.n_experts and (unused := [k for k in ("router_aux_loss_coef", "router_z_loss_coef", "n_experts_per_tok",
                                                    "moe_ffn_dim") if k in training or k in overrides]):
        raise ConfigError(f"model.{unused[0]} is set but the model has no experts (a dense model); drop it or pick a "
                          "mixture-of-experts preset (e.g. debug_moe, qwen3_30b_a3b)")
    if tokenizer_vocab > mc.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer_vocab} tokens but the model's vocab_size is {mc.vocab_size}; "
                          f"set --model.vocab_size={tokenizer_vocab} or use a matching tokenizer")
    return mc


def materialize_weights(model: Transformer, cfg: Config, device: torch.device) -> None:
    """Real storage for this rank's shards, filled by a shard-invariant init or from the HF files.

    NF4 base weights (lora.base_dtype=nf4) are filled in bf16 shard by shard and quantised in place
    (`shardlm.quant.nf4.quantize_into`): no rank holds more than its own shards unquantised.
    """
    device = torch.device("cpu") if cfg.train.cpu_offload else device
    model.to_empty(device=device)
    if not cfg.model.init_from:
        _init_weights(model, cfg, device)  # LoRA adapters start here too (B = 0)
        return
    # The HF files / the checkpoint hold every base weight (the loaders error on any missing): draw only
    # the adapters, not 70B numbers that the load overwrites.
    model.init_weights(seed=cfg.train.seed, shard_view=shard_view, only=is_lora_param)
    if cfg.model.dcp_dir is not None:
        load_dcp_weights(model, cfg.model.dcp_dir, forms=STORED_FORMS)
        return
    load_hf_weights(model, cfg.model.hf_dir)


def _init_weights(model: Transformer, cfg: Config, device: torch.device) -> None:
    """`init_weights` on every parameter; an NF4 one is drawn (the same numbers) into a plain buffer of this
    rank's rows, then quantised (`quantize_into`)."""
    nf4 = nf4_params(model)
    model.init_weights(seed=cfg.train.seed, shard_view=shard_view, only=lambda n: n not in nf4)
    if not nf4:
        return

    def fill(name: str, p: torch.Tensor, shape: tuple[int, ...], row0: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=torch.float32, device=device)
        model.init_weights(seed=cfg.train.seed, shard_view=lambda q: (buf, row0) if q is p else shard_view(q),
                           only=lambda n: n == name)
        return buf

    quantize_into(model, fill, device)


def meta_model(cfg: Config, mc: ModelConfig, device_type: str = "cuda") -> Transformer:
    """The model on the meta device (no memory), with LoRA adapters and the frozen base marked and stored
    as lora.base_dtype says (resolved for `device_type`): bf16 / fp32, or NF4 for the target linears."""
    lo = cfg.lora
    with torch.device("meta"):
        model = Transformer(mc)
    if lo.rank > 0:
        try:
            apply_lora(model, lo.rank, lo.alpha, lo.dropout, lo.targets, train_embeddings=lo.train_embeddings,
                       train_norms=lo.train_norms)
        except ValueError as e:
            raise ConfigError(f"lora.targets: {e}") from None
        if base_dtype(cfg, device_type) == "nf4":
            apply_nf4(nf4_targets(model))
        cast_frozen(model, frozen_dtype(cfg, device_type), keep=is_nf4)
    return model


def model_state_bytes(cfg: Config, mc: ModelConfig, device_type: str = "cuda") -> int:
    """Bytes of model state over all ranks: fp32 weights + gradients + two AdamW moments (16 bytes; 12 with
    train.optimizer_state_dtype=bf16, ~10 with int8) per trained parameter, the frozen base as stored (lora.base_dtype: 4 bytes fp32, 2 bf16, ~0.52 NF4).
    What `parallel.dp_shard=auto` shares out."""
    total = 0
    per_trained = 8 + {"fp32": 8, "bf16": 4, "int8": 2}[cfg.train.optimizer_state_dtype]  # + the two moments
    for p in meta_model(cfg, mc, device_type).parameters():
        if p.requires_grad:
            total += per_trained * p.numel()
        else:
            total += nf4_nbytes(p.numel()) if is_nf4(p) else p.numel() * p.dtype.itemsize
    return total


def build_model(cfg: Config, mc: ModelConfig, mesh: DeviceMesh | None, device: torch.device,
                materialize: Materialize = materialize_weights) -> Transformer:
    """The model of `cfg`, sharded over `mesh`; no rank ever holds the whole model. `mesh=None`: one plain
    process (inference outside torchrun): nothing is sharded and the parameters take the compute dtype that
    FSDP's all-gather would give them (buffers stay fp32)."""
    t = cfg.train
    model = meta_model(cfg, mc, device.type)
    shard_mesh = fsdp_mesh(mesh) if mesh is not None else None
    if shard_mesh is not None and base_dtype(cfg, device.type) == "nf4":
        check_shapes(nf4_targets(model), shard_mesh.size(shard_mesh.ndim - 1))  # the shard dimension (last in HSDP)
    if (cp := cp_size(mesh) if mesh is not None else 1) > 1:
        check_cp(cp, mc.n_heads, cfg.data.seq_len)
        apply_context_parallel(model, mesh["cp"].get_group(), mesh["cp"].get_local_rank(), cp)
    if t.mixed_precision == "fp8":
        check_fp8_hardware(device, t.fp8_emulate)
        apply_fp8(model, t.fp8_recipe, t.fp8_emulate, uses_fp8_all_gather(cfg, device))
    apply_ac(model, t.ac, every=t.ac_every)
    if t.compile:
        apply_compile(model, t.compile_backend)
    policy = mp_policy(t.precision(device.type), t.reduce_dtype)
    if shard_mesh is not None:
        apply_fsdp(model, shard_mesh, policy, cfg.parallel.reshard_after_forward, cpu_offload=t.cpu_offload,
                   prefetch=cfg.parallel.prefetch)
    materialize(model, cfg, device)
    if mesh is None:
        for p in model.parameters():
            p.data = p.data.to(policy.param_dtype)
    return model
