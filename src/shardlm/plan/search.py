"""When a config does not fit: which knob, alone or with full activation checkpointing, would.

Each alternative is a fake run of a config variant. Runs that cannot fit are not run: the model
state (sharded params + grads + optimizer state) measured in an earlier run with the same ranks
and LoRA setting is a lower bound on the peak that AC and the micro-batch size do not change; such
alternatives are listed with that bound and `measured=False`. 4x the ranks is only tried when 2x
does not fit. When the config fits, `train.grad_sync=step` is offered where it also fits (less
gradient traffic for more memory).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from shardlm.config import Config, set_value
from shardlm.plan.report import Scenario, fmt_bytes, gib

Measure = Callable[[Config, int, str, dict], Scenario]  # (variant, world size, name, overrides) -> scenario


@dataclass(frozen=True)
class Knob:
    """One way to need less memory per rank."""

    name: str
    overrides: dict[str, Any]
    applies: Callable[[Config], bool] = lambda cfg: True


KNOBS = [  # tried one at a time, in this order, after train.ac=full and CPU offload
    Knob("lora.rank=16 (frozen base)", {"lora.rank": 16}, lambda cfg: cfg.lora.rank == 0),
]
COMBINED_WITH_AC = [  # tried with train.ac=full when no single knob fits
    Knob("lora.rank=16", {"lora.rank": 16}, lambda cfg: cfg.lora.rank == 0),
    Knob("micro_batch_size=1", {"train.micro_batch_size": 1}, lambda cfg: cfg.train.micro_batch_size > 1),
]
AC_FULL = {"train.ac": "full"}


def variant(cfg: Config, overrides: dict[str, Any]) -> Config:
    """A copy of `cfg` with `overrides` (type-checked like command-line overrides)."""
    c = copy.deepcopy(cfg)
    for k, v in overrides.items():
        set_value(c, k, v)
    return c


@dataclass
class Search:
    cfg: Config
    base: Scenario
    usable: int
    gpus_per_node: int
    measure: Measure
    n_heads: int = 0  # the model's attention heads (parallel.cp must divide them); 0: CP is not tried
    out: list[Scenario] = field(default_factory=list)
    # (ranks, lora rank, lora base dtype) -> a measured scenario whose model state bounds every variant like it
    bounds: dict[tuple[int, int, str], Scenario] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.bounds[(self.base.world_size, self.cfg.lora.rank, self.cfg.lora.base_dtype)] = self.base

    def run(self, name: str, overrides: dict[str, Any], ranks: int = 1, keep: bool = True) -> Scenario:
        ws = self.base.world_size * ranks
        if ranks != 1:
            overrides = {**overrides, "parallel.dp_shard": -1}
        v = variant(self.cfg, overrides)
        ref = self.bounds.get((ws, v.lora.rank, v.lora.base_dtype))
        bound = 0 if ref is None or v.train.cpu_offload else ref.model_state.total
        if bound > self.usable:
            s = dataclasses.replace(
                self.base, name=name, world_size=ws, micro_batch_size=v.train.micro_batch_size, ac=v.train.ac,
                lora_rank=v.lora.rank, peak_bytes=bound, offload_peak_bytes=0, seconds=0.0, overrides=overrides,
                measured=False,
                note=f"not run: the model state alone is {gib(bound):.1f} GiB > {gib(self.usable):.1f} GiB usable")
        else:
            s = self.measure(v, ws, name, overrides)
            self.bounds.setdefault((ws, v.lora.rank, v.lora.base_dtype), s)
        if keep:
            self.out.append(s)
        return s

    def offload(self, s: Scenario, name: str) -> Scenario:
        """`s` with CPU offload: no extra run, its offload peak is measured with every step."""
        o = dataclasses.replace(s, name=name, cpu_offload=True, peak_bytes=s.offload_device.total, seconds=0.0,
                                overrides={**s.overrides, "train.cpu_offload": True},
                                note="estimate: sharded params, grads and optimizer state in host memory")
        self.out.append(o)
        return o

    def more_ranks(self, prefix: str, overrides: dict[str, Any]) -> None:
        for k in (2, 4):
            ws = self.base.world_size * k
            label = f"{prefix}{k}x ranks: {ws} ({ws / self.gpus_per_node:g} x {self.gpus_per_node} GPUs)"
            if self.run(label, overrides, ranks=k).fits:
                return

    def context_parallel(self, prefix: str, overrides: dict[str, Any]) -> None:
        """The largest parallel.cp a node takes, on the same ranks (one plan): each sequence's activations split
        over a CP group inside a node; the parameters shard over dp_shard x cp, as before."""
        for cp in cp_degrees(self.cfg, self.base.world_size, self.gpus_per_node, self.n_heads)[-1:]:
            self.run(f"{prefix}parallel.cp={cp}", {**overrides, "parallel.cp": cp, "parallel.dp_shard": -1})

    def micro_batches(self, notes: list[str]) -> None:
        """micro_batch_size=1, then the largest that fits (the peak is ~linear in it)."""
        mb = self.cfg.train.micro_batch_size
        one = self.run("train.micro_batch_size=1", {"train.micro_batch_size": 1})
        if one.fits and one.measured:
            per_seq = (self.base.peak_bytes - one.peak_bytes) / (mb - 1)
            k = min(mb - 1, int(1 + (self.usable - one.peak_bytes) / per_seq)) if per_seq > 0 else mb - 1
            if k > 1 and not self.run(f"train.micro_batch_size={k}", {"train.micro_batch_size": k}).fits and k > 2:
                self.run(f"train.micro_batch_size={k - 1}", {"train.micro_batch_size": k - 1})
        notes.append("a smaller micro-batch shrinks the global batch; raise train.grad_accum to keep it (with "
                     "train.grad_sync=micro_batch that costs no memory)")


def cp_degrees(cfg: Config, world_size: int, gpus_per_node: int, n_heads: int) -> list[int]:
    """Context-parallel degrees worth planning for `cfg`: none when it already uses CP; else 2, 4, 8, ... up to a
    node (a CP group's all-to-alls stay on NVLink) that divide the `n_heads` attention heads, data.seq_len and
    the ranks left after parallel.dp_replicate."""
    if cfg.parallel.cp != 1:
        return []
    rep = cfg.parallel.dp_replicate if isinstance(cfg.parallel.dp_replicate, int) else 1
    out, cp = [], 2
    while cp <= min(gpus_per_node, world_size):
        if n_heads % cp == 0 and cfg.data.seq_len % cp == 0 and world_size % (rep * cp) == 0:
            out.append(cp)
        cp *= 2
    return out


def alternatives(cfg: Config, base: Scenario, usable: int, gpus_per_node: int, measure: Measure,
                 notes: list[str], n_heads: int = 0) -> list[Scenario]:
    """Alternatives for a config that does not fit: each knob alone, then combined with train.ac=full
    (parallel.cp among them for a model of `n_heads` heads)."""
    s = Search(cfg, base, usable, gpus_per_node, measure, n_heads=n_heads)
    ac_full = s.run("train.ac=full", AC_FULL) if cfg.train.ac != "full" else None
    if not base.cpu_offload:
        s.offload(base, "train.cpu_offload=true")
    s.more_ranks("", {})
    for knob in KNOBS:
        if knob.applies(cfg):
            s.run(knob.name, knob.overrides)
    s.context_parallel("", {})
    if cfg.train.micro_batch_size > 1:
        s.micro_batches(notes)
    if any(x.fits for x in s.out) or ac_full is None:
        return s.out
    if not base.cpu_offload:  # no single knob fits: combine each with full AC
        measured = ac_full if ac_full.measured else s.run("train.ac=full", {**AC_FULL, "train.cpu_offload": True},
                                                         keep=False)
        s.offload(measured, "train.ac=full + cpu_offload")
    s.more_ranks("train.ac=full + ", AC_FULL)
    s.context_parallel("train.ac=full + ", AC_FULL)
    for knob in COMBINED_WITH_AC:
        if knob.applies(cfg):
            s.run(f"train.ac=full + {knob.name}", {**AC_FULL, **knob.overrides})
    return s.out


def fitting_extras(cfg: Config, base: Scenario, usable: int, gpus_per_node: int, measure: Measure) -> list[Scenario]:
    """For a config that fits: train.grad_sync=step (one gradient reduce-scatter per step instead of one per
    micro-batch), listed when it fits too."""
    if not (cfg.train.grad_accum > 1 and cfg.train.grad_sync == "micro_batch"):
        return []
    s = Search(cfg, base, usable, gpus_per_node, measure)
    step = s.run("train.grad_sync=step", {"train.grad_sync": "step"}, keep=False)
    if not step.fits:
        return []
    n = cfg.train.grad_accum
    return [dataclasses.replace(step, note=f"{n - 1} of {n} gradient reduce-scatters saved, for "
                                           f"{fmt_bytes(step.peak_bytes - base.peak_bytes)} more (unsharded "
                                           "gradients during accumulation)")]
