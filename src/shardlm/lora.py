"""LoRA (Hu et al., 2021) for our Transformer, numerically identical to peft's plain LoRA.

`apply_lora` swaps target `nn.Linear`s for `LoRALinear`, which keeps the base `weight`/`bias`
Parameters under the same names (checkpoints and the HF key mapping are unchanged) and adds
`lora_A` (in -> r) and `lora_B` (r -> out):

    y = x W^T + b + lora_B(lora_A(dropout(x))) * alpha / r

That is peft's non-rslora, non-DoRA forward, and the names match peft's once the adapter name is
dropped, so `shardlm.interop.peft` writes an adapter that `peft.PeftModel.from_pretrained` loads
(`to_peft_state_dict` / `peft_adapter_config`) and reads one back (`from_peft_state_dict`).

Order in the trainer: build on `meta` -> `apply_lora` -> `fully_shard` -> `to_empty` ->
`init_weights` (which asks each LoRA factor for its `init_spec`) -> load the base checkpoint.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardlm.models.llama import InitSpec, RMSNorm
from shardlm.models.moe import PROJECTIONS, Experts

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_NORMS = (RMSNorm, nn.LayerNorm, nn.RMSNorm)


def lora_a_std(in_features: int) -> float:
    """Std of the initial lora_A: 1/sqrt(3*in), the std of peft's default kaiming_uniform_(a=sqrt(5))
    (U(-1/sqrt(in), 1/sqrt(in))). init_weights draws it from a normal, as fill_param only does normals."""
    return 1.0 / math.sqrt(3 * in_features)


def is_lora_param(name: str) -> bool:
    """True for `...lora_A.weight` / `...lora_B.weight` (any wrapper prefixes allowed)."""
    parts = name.split(".")
    return "lora_A" in parts or "lora_B" in parts


class LoRAFactor(nn.Linear):
    """lora_A or lora_B: a bias-free nn.Linear that tells `Transformer.init_weights` how it starts.

    (init_weights consults the module that owns a parameter directly, which for `q_proj.lora_A.weight`
    is this one, not the LoRALinear around it.)
    """

    def __init__(self, in_features: int, out_features: int, spec: InitSpec, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self.spec = spec

    def init_spec(self, pname: str) -> InitSpec | None:
        return self.spec if pname == "weight" else None


class LoRALinear(nn.Linear):
    """nn.Linear plus a low-rank update; `weight`/`bias` are the (frozen) base parameters."""

    def __init__(self, in_features: int, out_features: int, r: int, alpha: float, dropout: float = 0.0,
                 bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._add_lora(r, alpha, dropout, self.weight.device, self.weight.dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, r: int, alpha: float, dropout: float = 0.0) -> LoRALinear:
        """Wrap `linear`, reusing its Parameter objects (no copy; works on the meta device)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        if linear.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = linear.bias
        self._add_lora(r, alpha, dropout, linear.weight.device, linear.weight.dtype)
        return self

    def _add_lora(self, r: int, alpha: float, dropout: float, device: torch.device, dtype: torch.dtype) -> None:
        if r <= 0:
            raise ValueError(f"LoRA rank must be positive, got {r}")
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = LoRAFactor(self.in_features, r, ("normal", lora_a_std(self.in_features)), device, dtype)
        self.lora_B = LoRAFactor(r, self.out_features, ("zeros",), device, dtype)
        self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """peft's default start: A ~ kaiming_uniform_(a=sqrt(5)) (nn.Linear's own init), B = 0, so the
        wrapped layer starts out equal to the base. A no-op on the meta device (init_weights fills it)."""
        if self.lora_A.weight.is_meta:
            return
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        self.lora_B.weight.zero_()

    def init_spec(self, pname: str) -> InitSpec | None:
        """lora_A ~ N(0, lora_a_std(in)), lora_B = 0; the base weight/bias: None (the model decides)."""
        if pname in ("lora_A.weight", "lora_B.weight"):
            return getattr(self, pname.split(".")[0]).spec
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, alpha={self.alpha}"


def nf4_targets(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(parameter name, owning module, attribute) of every adapted base weight: the LoRA linears' `weight` and the
    stacked experts' adapted projections, the frozen bases QLoRA stores as NF4."""
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            yield f"{name}.weight", m, "weight"
        elif isinstance(m, Experts) and m.lora_A is not None:
            for p in m.lora_A.keys():
                yield f"{name}.{p}", m, p


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
               targets: Iterable[str] = DEFAULT_TARGETS, train_embeddings: bool = False,
               train_norms: bool = False) -> list[str]:
    """Wrap every nn.Linear whose attribute name is in `targets` in a LoRALinear; return their names.

    Afterwards only LoRA parameters require grad, plus nn.Embedding weights and the untied output
    head `lm_head` if `train_embeddings`, and norm gains if `train_norms`. Works on a meta-device
    model (before fully_shard) and on a materialised one (LoRA then starts as peft's does).
    """
    targets = list(targets)
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("apply_lora: the model already has LoRA layers")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("apply_lora: the model is already sharded; call apply_lora before fully_shard")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    experts = {n: m for n, m in model.named_modules() if isinstance(m, Experts)}
    valid = sorted({n.rpartition(".")[2] for n in linears} | (set(PROJECTIONS) if experts else set()))
    unknown = [t for t in targets if t not in valid]
    if unknown or not targets:
        raise ValueError(f"LoRA target(s) {unknown or targets} match no nn.Linear or expert projection in the model; "
                         f"valid names: {', '.join(valid)}")
    replaced = [n for n in linears if n.rpartition(".")[2] in targets]
    for name in replaced:
        _set_submodule(model, name, LoRALinear.from_linear(linears[name], rank, alpha, dropout))
    stacked = [p for p in PROJECTIONS if p in targets]  # a mixture of experts: the same names adapt every expert
    for name, m in experts.items():
        if stacked:
            m.add_lora(stacked, rank, alpha, dropout, lambda n_in: ("normal", lora_a_std(n_in)))
            replaced += [f"{name}.{p}" for p in stacked]

    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_param(name))
    for name, m in model.named_modules():
        if (train_embeddings and (isinstance(m, nn.Embedding) or name.rpartition(".")[2] == "lm_head")) or (
            train_norms and isinstance(m, _NORMS)
        ):
            for p in m.parameters(recurse=False):
                p.requires_grad_(True)
    return replaced


@torch.no_grad()
def cast_frozen(model: nn.Module, dtype: torch.dtype,
                keep: Callable[[torch.Tensor], bool] = lambda p: False) -> list[str]:
    """Store every frozen floating-point parameter in `dtype` (lora.base_dtype); returns their names.

    Trained parameters (adapters, and embeddings / norms when trained) keep their fp32 master weights; those
    `keep` names stay as they are (the build passes `quant.nf4.is_nf4`: NF4 parameters stay NF4); tied
    parameters stay one parameter. Run it before fully_shard (on the meta model).
    """
    new: dict[int, nn.Parameter] = {}
    names = []
    for mod_name, m in model.named_modules(remove_duplicate=False):
        for pname, p in list(m.named_parameters(recurse=False)):
            if p.requires_grad or not p.is_floating_point() or p.dtype == dtype or keep(p):
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
                names.append(f"{mod_name}.{pname}" if mod_name else pname)
            setattr(m, pname, new[id(p)])
    return names


def lora_delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """What an adapter adds to its base weight, B @ A * alpha/r, in fp32: the merge arithmetic, once (merge_lora,
    the HF export and inference's merge on load all add it to their base weights). Stacked experts' factors
    (n_experts, out, r) and (n_experts, r, in) give each expert's."""
    return (b.float() @ a.float()) * scaling


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Fold B @ A * scaling into each base weight in place and swap back a plain nn.Linear (for export).

    The merged weights keep their requires_grad flags. Run it on an unsharded, materialised model.
    Returns the merged module names.
    """
    experts = []
    for n, m in model.named_modules():
        if isinstance(m, Experts) and m.lora_A is not None:  # W[e] += B[e] @ A[e] * scaling, every expert at once
            for p in m.lora_A.keys():
                w = getattr(m, p)
                w.add_(lora_delta(m.lora_A[p], m.lora_B[p], m.lora_scaling).to(w.dtype))
                experts.append(f"{n}.{p}")
            m.drop_lora()
    merged = [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    for name, m in merged:
        delta = lora_delta(m.lora_A.weight, m.lora_B.weight, m.scaling)
        m.weight.add_(delta.to(m.weight.dtype))
        plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        plain.weight = m.weight
        if m.bias is not None:
            plain.bias = m.bias
        _set_submodule(model, name, plain)
    return [n for n, _ in merged] + experts


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA entries of `model.state_dict()` only."""
    return {k: v for k, v in model.state_dict().items() if is_lora_param(k)}
