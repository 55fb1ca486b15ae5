"""QLoRA's frozen base (lora.base_dtype=nf4): the LoRA target linears' weights as torchao `NF4Tensor`s.

NF4 (Dettmers et al., 2023) stores each weight as a 4-bit index into 16 NormalFloat levels, scaled by the
absmax of its block of 64; those block scales are quantised again ("double quantisation") to int8 per
scaler block of 256 scales, after subtracting the mean of all the tensor's scales. Per weight:
0.5 byte + 1/64 byte (int8 scale) + 2/16384 byte (bf16 second-level factor), plus 2 bytes of mean and a
32-byte lookup table per tensor: ~0.516 bytes against bf16's 2.

How it goes through FSDP2. `NF4Tensor` implements FSDP2's all-gather extension: the all-gather inputs are
its three inner tensors (packed indices, int8 scales, factors), so the weights travel in NF4 and are
dequantised per matmul (`linear_nf4`). The gathered tensor keeps the *rank-local* `scaler_mean`, and
the int8 scales of a scaler block are relative to that block's factor, so a shard decodes correctly
after the gather only when
  1. every shard holds whole scaler blocks (its numel is a multiple of 64 * 256 = 16384), and FSDP
     shards evenly (out_features % dp_shard == 0): `check_shapes` says which layer breaks this;
  2. every shard was quantised with the mean of the *whole* tensor's block scales.
`quantize_shard` does exactly that: each rank takes the absmax of its own blocks, one all-gather of
those gives every rank the whole tensor's scale vector (numel/64 bf16 values, 1/32 of the weight's bf16
bytes, for a moment), whose `.mean()` is the same op on the same values as `to_nf4` takes on the whole
tensor; the rest is local. (An all-reduced sum would be cheaper but rounds differently from torch's mean:
not bitwise.) So the gathered weight is bitwise what `to_nf4(whole tensor)` gives (tested), and no rank
ever holds more than its own shard in bf16.

Checkpoints hold an NF4 weight as its plain pieces (`nf4_pieces`), never an NF4Tensor (DCP would pickle
it); the export dequantises them (`from_pieces`, via CheckpointReader); a resume does not load them (the
build has re-quantised the same bits from model.init_from or the seed). `NF4_FORM` is how checkpoint/ sees
all this (its `StoredForm` protocol: checkpoint/ knows no NF4, and this module does not import it).

Build order (shardlm.build): meta model -> LoRA -> `apply_nf4` (meta NF4 parameters: shapes only, no
arithmetic) -> fully_shard (splits them into per-rank NF4 shards) -> to_empty -> each rank fills its
shards from the HF files / the init / a DCP checkpoint in bf16 and `assign_quantized` swaps in the
quantised shard. The planner stops after to_empty and `assign_empty`s fake NF4 shards of the true sizes.

Stacked experts (a mixture of experts' `(n_experts, out, in)` projections, LoRA-adapted): NF4Tensor is 2-D only,
so each such projection is one NF4 parameter `(n_experts * out, in)` (row `e * out + o` is expert e's row o), and
its owning module records the model's shape in `logical_shapes` (`model_shape`). Every expert's `out * in` is a
multiple of GROUP and every shard holds whole experts (`check_shapes`), so no NF4 block or scaler block spans two
experts or two ranks: NF4 per expert slice. Wherever names and shapes meet files (the HF load, the init, DCP
pieces, the export) the 3-D shape is used; only the parameter itself is flat.

The NF4 tensors are bf16-based (scales and dequantised weight in bf16) whatever the training precision:
under fp32 the dequantised base is upcast for the matmul; the adapters train in the training precision.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from shardlm._torch_compat import dtensor_local
from shardlm.errors import ConfigError
from shardlm.extras import require
from shardlm.models.llama import model_shape

BLOCK_SIZE = 64  # weights per absmax scale
SCALER_BLOCK_SIZE = 256  # scales per second-level (double quantisation) factor
GROUP = BLOCK_SIZE * SCALER_BLOCK_SIZE  # weights per second-level factor: a shard must hold whole groups
NF4_DTYPE = torch.bfloat16
_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"


def torchao_nf4() -> ModuleType:
    """torchao's nf4_tensor module (the [fp8] extra is torchao), imported on first use."""
    return require(_MODULE, "fp8", "lora.base_dtype=nf4")


def is_nf4(t: torch.Tensor) -> bool:
    """Whether `t` (a parameter, a DTensor or a local shard) holds NF4 data. Does not import torchao."""
    if isinstance(t, DTensor):
        t = dtensor_local(t)  # the local shard object itself (to_local() of a Parameter returns a view)
    return type(t).__name__ == "NF4Tensor"


def nf4_nbytes(numel: int) -> int:
    """Bytes of one NF4 tensor (or shard) of `numel` weights, as torchao stores it: packed 4-bit indices,
    int8 block scales, bf16 second-level factors, the bf16 scaler mean and the 16-level bf16 lookup table."""
    return numel // 2 + numel // BLOCK_SIZE + 2 * (numel // GROUP) + 2 + 2 * 16


# -- building (meta) ---------------------------------------------------------------------------------
def empty_nf4(shape: tuple[int, int], device: torch.device | str = "meta", dtype: torch.dtype = NF4_DTYPE):
    """An NF4Tensor of `shape` with uninitialised inner tensors of the right sizes (no arithmetic: cheap on
    the meta device and under FakeTensorMode)."""
    m = torchao_nf4()
    numel = math.prod(shape)
    n_blocks = numel // BLOCK_SIZE
    meta = m.SubclassTensorArgs(torch.Size(shape), (shape[1], 1), 0, dtype, torch.device(device), False)
    return m.NF4Tensor(meta, BLOCK_SIZE, n_blocks, SCALER_BLOCK_SIZE,
                       torch.empty(n_blocks, dtype=torch.int8, device=device),
                       torch.empty(n_blocks // SCALER_BLOCK_SIZE, dtype=dtype, device=device),
                       torch.empty((), dtype=dtype, device=device),
                       torch.empty(numel // 2, dtype=torch.uint8, device=device),
                       torch.empty(16, dtype=dtype, device=device))


# (parameter name, owning module, attribute): the frozen bases that go NF4 (`shardlm.lora.nf4_targets`)
Targets = Iterable[tuple[str, nn.Module, str]]


def check_shapes(targets: Targets, dp_shard: int) -> None:
    """ConfigError naming the first target weight (`shardlm.lora.nf4_targets`) that NF4 cannot hold sharded over
    `dp_shard` ranks."""
    for name, m, attr in targets:
        shape = model_shape(m, attr, getattr(m, attr))
        if len(shape) == 3:
            _check_stacked(name, shape, dp_shard)
            continue
        out_f, in_f = shape
        where = f"lora.base_dtype=nf4: {name} ({out_f}x{in_f})"
        if (out_f * in_f) % GROUP:
            raise ConfigError(f"{where} has {out_f * in_f} weights, not a multiple of {GROUP} (NF4 blocks of "
                              f"{BLOCK_SIZE} x scaler blocks of {SCALER_BLOCK_SIZE}); drop it from lora.targets or "
                              "use lora.base_dtype=bf16")
        if out_f % dp_shard or (out_f // dp_shard * in_f) % GROUP:
            raise ConfigError(f"{where} does not split into {dp_shard} NF4 shards: each shard needs whole rows "
                              f"(out_features % dp_shard == 0) and a multiple of {GROUP} weights ({in_f} x rows "
                              f"per shard); use a parallel.dp_shard that divides {out_f} into such row blocks "
                              f"(e.g. {_fitting_degrees(out_f, in_f, dp_shard)}), drop it from lora.targets, or "
                              "use lora.base_dtype=bf16")


def _check_stacked(name: str, shape: tuple[int, int, int], dp_shard: int) -> None:
    n_experts, out_f, in_f = shape
    where = f"lora.base_dtype=nf4: {name} ({n_experts} experts of {out_f}x{in_f})"
    if (out_f * in_f) % GROUP:
        raise ConfigError(f"{where}: an expert's {out_f * in_f} weights are not a multiple of {GROUP} (NF4 blocks of "
                          f"{BLOCK_SIZE} x scaler blocks of {SCALER_BLOCK_SIZE}); drop {name.rpartition('.')[2]} from "
                          "lora.targets or use lora.base_dtype=bf16")
    if n_experts % dp_shard:
        fits = ", ".join(str(d) for d in range(1, n_experts + 1) if n_experts % d == 0 and d <= 2 * dp_shard)
        raise ConfigError(f"{where} does not split into {dp_shard} NF4 shards of whole experts; use a "
                          f"parallel.dp_shard that divides {n_experts} ({fits}) with parallel.dp_replicate for the "
                          "other GPUs, drop the expert projections from lora.targets, or use lora.base_dtype=bf16")


def _fitting_degrees(out_f: int, in_f: int, near: int) -> str:
    ok = [d for d in range(1, 2 * near + 1) if out_f % d == 0 and (out_f // d * in_f) % GROUP == 0]
    return ", ".join(map(str, ok[-4:])) or "1"


@torch.no_grad()
def apply_nf4(targets: Targets) -> list[str]:
    """Swap each target's (meta) base weight (`shardlm.lora.nf4_targets`) for a meta NF4 parameter; returns the
    parameter names. A stacked `(n_experts, out, in)` weight becomes `(n_experts * out, in)`, its model shape
    recorded in the module's `logical_shapes`.

    Before fully_shard: FSDP2 recognises the NF4 all-gather extension on the parameter it shards.
    """
    torchao_nf4()
    names = []
    for name, m, attr in targets:
        w = getattr(m, attr)
        if not w.is_meta:
            raise ValueError("apply_nf4 runs on the meta model (before fully_shard and materialisation)")
        shape = tuple(w.shape)
        if len(shape) == 3:
            m.logical_shapes[attr] = shape
        setattr(m, attr, nn.Parameter(empty_nf4((math.prod(shape[:-1]), shape[-1])), requires_grad=False))
        names.append(name)
    return names


def nf4_params(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """{parameter name: (owning module, attribute name, parameter)} of the NF4 parameters."""
    out = {}
    for mod_name, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            if is_nf4(p):
                out[f"{mod_name}.{pname}" if mod_name else pname] = (m, pname, p)
    return out


# -- quantising: whole tensors and shards ------------------------------------------------------------
def _levels(device: torch.device) -> torch.Tensor:
    """The 16 NF4 levels, as torchao's `NF4Tensor.from_tensor` writes them (checked by a test)."""
    return torch.tensor([-1.0000, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0000, 0.0796, 0.1609,
                         0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0000], device=device, dtype=NF4_DTYPE)


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, BLOCK_SIZE).abs().max(dim=1).values  # torchao's get_block_absmax


def shard_group(p: torch.Tensor) -> tuple[dist.ProcessGroup | None, int, int]:
    """(group, rank in it, its size) of the mesh dimension `p` is sharded on (dim 0); (None, 0, 1) if none."""
    if not isinstance(p, DTensor):
        return None, 0, 1
    for i, pl in enumerate(p.placements):
        if isinstance(pl, Shard):
            if pl.dim != 0:
                raise ValueError(f"NF4 parameters are sharded on dim 0, not {pl.dim}")
            group = p.device_mesh.get_group(i)
            return group, dist.get_rank(group), dist.get_world_size(group)
    return None, 0, 1


@torch.no_grad()
def quantize_shard(local: torch.Tensor, group: dist.ProcessGroup | None = None):
    """NF4 of one dim-0 shard (`local`: this rank's rows) of a tensor sharded over `group` in rank order,
    bitwise equal to the same rows of `to_nf4(whole tensor)` (see the module docstring). With no group,
    `local` is the whole tensor. A collective over `group`: every rank calls it for the same tensor."""
    m = torchao_nf4()
    x = local.detach().to(NF4_DTYPE).contiguous()
    numel = x.numel()
    if x.dim() != 2 or numel % GROUP:
        raise ValueError(f"NF4 needs a 2-D shard with a multiple of {GROUP} weights, got {tuple(x.shape)}")
    absmax = _block_absmax(x)
    everyone = absmax
    if group is not None and dist.get_world_size(group) > 1:
        everyone = absmax.new_empty(absmax.numel() * dist.get_world_size(group))
        _all_gather(everyone, absmax, group)
    mean = everyone.mean()  # the same op on the same values as to_nf4 of the whole tensor: bitwise
    # torchao's NF4Tensor.double_quantize_scalers, with the whole tensor's mean
    centred = (absmax - mean).view(-1, SCALER_BLOCK_SIZE)
    factor = 256 / (2 * centred.abs().max(dim=1).values)
    q = (centred * factor.unsqueeze(-1)).round().clamp(-128, 127).flatten().to(torch.int8)
    levels = _levels(x.device)
    data = m.NF4Tensor.convert_to_norm_float_weight(x, absmax.numel(), BLOCK_SIZE, levels)
    meta = m.SubclassTensorArgs(x.size(), x.stride(), 0, NF4_DTYPE, x.device, False)
    return m.NF4Tensor(meta, BLOCK_SIZE, absmax.numel(), SCALER_BLOCK_SIZE, q, factor.contiguous(), mean, data,
                       levels)


def _all_gather(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup) -> None:
    # all_gather_single is the newer name (all_gather_into_tensor warns there); torch 2.11 has only the old one
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


def nf4_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """What QLoRA trains against for the weight `w`: `to_nf4(w in bf16)` dequantised (bf16)."""
    return quantize_shard(w).get_original_weight()


# -- putting shards in place -------------------------------------------------------------------------
@torch.no_grad()
def assign_quantized(module: nn.Module, pname: str, local_nf4: torch.Tensor) -> None:
    """Make `local_nf4` (this rank's NF4 shard) the data of `module.<pname>`, keeping its sharding.

    Through `load_state_dict(assign=True)`, which FSDP2 follows (it re-registers the new sharded parameter).
    """
    p = getattr(module, pname)
    if isinstance(p, DTensor):
        new = DTensor.from_local(local_nf4, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                 stride=p.stride())
    else:
        new = local_nf4
    module.load_state_dict({pname: nn.Parameter(new, requires_grad=False)}, strict=False, assign=True)


def local_shape(p: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """(shape of this rank's shard, its first row) of a dim-0 sharded parameter (or a whole one)."""
    if not isinstance(p, DTensor):
        return tuple(p.shape), 0
    shape = tuple(dtensor_local(p).shape)  # NF4 parameters are sharded evenly (check_shapes)
    return shape, shard_group(p)[1] * shape[0]


def local_region(module: nn.Module, pname: str, p: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """`local_shape` in the model's shape: (this rank's shard shape, its first index on dim 0); a stacked experts'
    shard is whole experts (`check_shapes`)."""
    shape, row0 = local_shape(p)
    full = model_shape(module, pname, p)
    if len(full) == 2:
        return shape, row0
    per = full[1]  # rows per expert
    return (shape[0] // per, per, shape[1]), row0 // per


def assign_empty(model: nn.Module, device: torch.device) -> None:
    """Uninitialised NF4 shards of the right sizes in every NF4 parameter (the planner's fake storage)."""
    for _, (m, pname, p) in nf4_params(model).items():
        assign_quantized(m, pname, empty_nf4(local_shape(p)[0], device=device))


def quantize_into(model: nn.Module, fill, device: torch.device) -> None:
    """Quantise every NF4 parameter's shard from bf16 values: `fill(name, param, shape, row0)` returns this
    rank's rows (a plain tensor) in the model's shape (`local_region`: whole experts of a stacked weight).
    Parameters go in name order on every rank (each is one all-gather)."""
    for name, (m, pname, p) in sorted(nf4_params(model).items()):
        shape, row0 = local_region(m, pname, p)
        plain = fill(name, p, shape, row0)
        group = shard_group(p)[0]
        assign_quantized(m, pname, quantize_shard(plain.reshape(-1, plain.shape[-1]).to(device), group))
        del plain


# -- checkpoints -------------------------------------------------------------------------------------
# An NF4 weight `X` is saved as `X.nf4.data` (packed indices, uint8), `X.nf4.scalers` (int8),
# `X.nf4.factors` (bf16): 1-D and sharded like the weight's rows (each rank's piece is its shard's), so
# their concatenation is `to_nf4` of the whole weight; `X.nf4.mean` and `X.nf4.shape` (the model's shape:
# 2 int64, 3 for stacked experts) are the same on every rank. Plain tensors: DCP writes them as tensors (an NF4Tensor would be pickled).
PIECES = {"data": "quantized_data", "scalers": "quantized_scalers", "factors": "quantization_factor"}
ALL_PIECES = frozenset([*PIECES, "mean", "shape"])
NF4_KEY = ".nf4."


def nf4_pieces(state: dict, shapes: dict[str, tuple[int, ...]] | None = None) -> dict:
    """`state` (a model state dict) with each NF4 entry replaced by its plain pieces (see above); `shapes`: the
    model's shape of the entries that differ from the tensor's (`model_shape`)."""
    shapes = shapes or {}
    out = {}
    for k, v in state.items():
        if not is_nf4(v):
            out[k] = v
            continue
        loc = dtensor_local(v) if isinstance(v, DTensor) else v
        for piece, attr in PIECES.items():
            t = getattr(loc, attr)
            if isinstance(v, DTensor):
                n = t.numel() * v.numel() // loc.numel()
                t = DTensor.from_local(t, v.device_mesh, v.placements, run_check=False, shape=(n,), stride=(1,))
            out[f"{k}{NF4_KEY}{piece}"] = t
        out[f"{k}{NF4_KEY}mean"] = loc.scaler_mean.detach().clone()
        out[f"{k}{NF4_KEY}shape"] = torch.tensor(list(shapes.get(k, v.shape)), dtype=torch.int64)
    return out


def from_pieces(pieces: dict[str, torch.Tensor]) -> torch.Tensor:
    """The bf16 weight, in the model's shape, that whole pieces {"data", "scalers", "factors", "mean", "shape"}
    stand for."""
    m = torchao_nf4()
    shape = torch.Size(int(n) for n in pieces["shape"].tolist())
    numel = math.prod(shape)
    flat = (numel // shape[-1], shape[-1])  # what the NF4 tensor held (stacked experts: flattened)
    meta = m.SubclassTensorArgs(torch.Size(flat), (flat[1], 1), 0, NF4_DTYPE, pieces["data"].device, False)
    t = m.NF4Tensor(meta, BLOCK_SIZE, numel // BLOCK_SIZE, SCALER_BLOCK_SIZE, pieces["scalers"], pieces["factors"],
                    pieces["mean"].to(NF4_DTYPE), pieces["data"], _levels(pieces["data"].device))
    return t.get_original_weight().view(shape)


def _bf16_like(m: nn.Module, pname: str, p: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor in the model's shape, this rank holding the rows of `p`'s shard, for DCP to read into."""
    local = torch.empty(local_region(m, pname, p)[0], dtype=NF4_DTYPE, device=p.device)
    if not isinstance(p, DTensor):
        return local
    shape = model_shape(m, pname, p)  # whole experts per shard: Shard(0) of the 3-D shape holds the same rows
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class NF4Form:
    """The NF4 base weights as a checkpoint holds them: shardlm.checkpoint.stored's `StoredForm` (duck-typed:
    quant sits below checkpoint). Saved as their pieces (above); an init load reads the plain weight into
    bf16 buffers of this rank's rows and quantises them (`quantize_into`)."""

    header = ("shape",)

    def names(self, model: nn.Module) -> set[str]:
        return set(nf4_params(model))

    def to_stored(self, state: dict, model: nn.Module) -> dict:
        return nf4_pieces(state, {n: model_shape(m, pname, p) for n, (m, pname, p) in nf4_params(model).items()})

    def group(self, keys: Iterable[str]) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for key in keys:
            base, sep, piece = key.rpartition(NF4_KEY)
            if sep:
                out.setdefault(base, {})[piece] = key
        for base, pieces in out.items():
            if set(pieces) != ALL_PIECES:
                raise ValueError(f"NF4 weight {base!r} is incomplete (has {sorted(pieces)})")
        return out

    def describe(self, header: dict[str, torch.Tensor]) -> tuple[tuple[int, ...], torch.dtype]:
        return tuple(int(n) for n in header["shape"].tolist()), NF4_DTYPE

    def assemble(self, pieces: dict[str, torch.Tensor]) -> torch.Tensor:
        return from_pieces(pieces)

    def plain_like(self, model: nn.Module, name: str) -> torch.Tensor:
        return _bf16_like(*nf4_params(model)[name])

    def fill(self, model: nn.Module, plain: dict[str, torch.Tensor]) -> None:
        """Quantise every NF4 parameter of `model` from `plain` (which holds each)."""
        quantize_into(model, lambda name, *_: _local(plain[name]), next(iter(plain.values())).device)


NF4_FORM = NF4Form()
