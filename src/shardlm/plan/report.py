"""What a plan says: bytes per rank by category, one Scenario per config variant, the report."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from shardlm.plan.device import DeviceTerms

GIB = 1024**3
DEFAULT_HEADROOM = 0.10

# FSDPMemTracker category names (their `.value`) -> the planner's groups.
_GROUPS = {
    "params": ("Sharded Param", "Unsharded Param", "Buffer"),
    "grads": ("Sharded Grad", "Unsharded Grad"),
    "optimizer": ("OptState",),
    "activations": ("Activation", "Inputs"),
    "temporaries": ("Temp",),
    "comm": ("All Gather", "Reduce Scatter"),
}
OFFLOADED = ("Sharded Param", "Sharded Grad", "OptState")


def gib(b: float) -> float:
    return b / GIB


def fmt_bytes(b: float, signed: bool = False) -> str:
    """Bytes for people: GiB, or MiB below 1 GiB."""
    v, unit = (b / GIB, "GiB") if abs(b) >= GIB else (b / 2**20, "MiB")
    return f"{v:+.2f} {unit}" if signed else f"{v:.2f} {unit}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


@dataclass
class Breakdown:
    """Bytes per rank, grouped (see the module docstring); `raw` keeps the tracker's own categories."""

    total: int
    params: int
    grads: int
    optimizer: int
    activations: int
    temporaries: int
    comm: int
    raw: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_flat(cls, flat: dict[str, int]) -> Breakdown:
        """From category name -> bytes (with "Total"; a planner-only "offload" entry is ignored)."""
        total = flat.get("Total", 0)
        raw = {k: v for k, v in flat.items() if k not in ("Total", "offload")}
        groups = {g: sum(raw.get(n, 0) for n in names) for g, names in _GROUPS.items()}
        return cls(total=total, raw=raw, **groups)


@dataclass
class Scenario:
    """One fake run: a config variant and what it needs per rank."""

    name: str
    world_size: int
    micro_batch_size: int
    seq_len: int
    grad_accum: int
    ac: str
    lora_rank: int
    cpu_offload: bool
    peak: Breakdown  # composition at the peak
    model_state: Breakdown  # after backward, before the optimizer step
    offload_peak_bytes: int  # the tensors' peak without sharded params/grads/optimizer state (CPU offload)
    device: DeviceTerms  # the GPU at the peak: tensors, reserved, context, NCCL (`plan.device`)
    offload_device: DeviceTerms  # the same with train.cpu_offload (what stays on the GPU)
    peak_bytes: int  # what the GPU needs: device.total (offload_device.total with cpu_offload)
    usable_bytes: int
    seconds: float
    overrides: dict[str, Any] = field(default_factory=dict)
    measured: bool = True  # False: not run, peak_bytes is a lower bound (see `note`)
    note: str = ""
    lora_base_dtype: str = ""  # with LoRA: how the frozen base is stored (lora.base_dtype resolved), else ""

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes

    @property
    def margin_bytes(self) -> int:
        """usable - peak: > 0 is room to spare, < 0 is how much is missing."""
        return self.usable_bytes - self.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("device", "offload_device"):
            terms = getattr(self, k)
            d[k].update(cublas=terms.cublas, fragmentation=terms.fragmentation, total=terms.total)
        d["fits"], d["margin_bytes"] = self.fits, self.margin_bytes
        d["peak_gib"], d["margin_gib"] = round(gib(self.peak_bytes), 3), round(gib(self.margin_bytes), 3)
        return d


@dataclass
class PlanReport:
    model: str
    n_params: int
    trainable_params: int
    world_size: int
    gpus_per_node: int
    gpu_mem_gib: float
    headroom: float
    base: Scenario
    alternatives: list[Scenario] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    document_attention: str = ""  # with data.document_mask: "flex: why" or "sdpa-mask: why" (plan.attention)
    host: Any = None  # plan.host.HostTerms: host memory per rank and node
    active_params: int | None = None  # a mixture of experts: what one token runs through (None: dense)

    @property
    def fits(self) -> bool:
        return self.base.fits

    @property
    def usable_gib(self) -> float:
        return self.gpu_mem_gib * (1 - self.headroom)

    @property
    def peak_gib(self) -> float:
        return gib(self.base.peak_bytes)

    def best_alternative(self) -> Scenario | None:
        """The fitting alternative with the most room left, if any."""
        ok = [s for s in self.alternatives if s.fits]
        return max(ok, key=lambda s: s.margin_bytes) if ok else None

    def to_dict(self) -> dict[str, Any]:
        best = self.best_alternative()
        return {
            "model": self.model, "n_params": self.n_params, "active_params": self.active_params,
            "trainable_params": self.trainable_params,
            "world_size": self.world_size, "gpus_per_node": self.gpus_per_node, "gpu_mem_gib": self.gpu_mem_gib,
            "headroom": self.headroom, "usable_gib": round(self.usable_gib, 3), "fits": self.fits,
            "peak_gib": round(self.peak_gib, 3), "base": self.base.to_dict(),
            "alternatives": [s.to_dict() for s in self.alternatives],
            "best_alternative": best.name if best else None, "notes": self.notes, "seconds": round(self.seconds, 2),
            "document_attention": self.document_attention or None,
            "host": None if self.host is None else {**dataclasses.asdict(self.host), "per_node": self.host.per_node},
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def format(self) -> str:
        """A short human-readable report."""
        b = self.base
        nodes = self.world_size / self.gpus_per_node
        lines = [
            f"shardlm plan: {self.model} ({_count(self.n_params)} params, "
            f"{f'{_count(self.active_params)} active, ' if self.active_params else ''}"
            f"{_count(self.trainable_params)} trainable) "
            f"on {self.world_size} ranks ({nodes:g} x {self.gpus_per_node} GPUs) of {self.gpu_mem_gib:g} GiB; "
            f"usable {fmt_bytes(b.usable_bytes)} ({self.headroom:.0%} headroom)",
            f"  micro_batch_size={b.micro_batch_size} seq_len={b.seq_len} grad_accum={b.grad_accum} ac={b.ac} "
            f"lora.rank={b.lora_rank}{f' (base {b.lora_base_dtype})' if b.lora_base_dtype else ''} "
            f"cpu_offload={str(b.cpu_offload).lower()}",
            *([f"  document masks ({self.document_attention})"] if self.document_attention else []),
            "",
            f"  {'per rank':<14} {'at peak':>12} {'model state':>12}",
        ]
        for g in ("params", "grads", "optimizer", "activations", "temporaries", "comm"):
            lines.append(f"  {g:<14} {fmt_bytes(getattr(b.peak, g)):>12} {fmt_bytes(getattr(b.model_state, g)):>12}")
        lines.append(f"  {'tensors':<14} {fmt_bytes(b.peak.total):>12} {fmt_bytes(b.model_state.total):>12}")
        if b.cpu_offload:
            lines.append(f"  tensors on the GPU with cpu_offload (estimate): {fmt_bytes(b.offload_peak_bytes)}")
        lines += device_lines(b.offload_device if b.cpu_offload else b.device)
        verdict = "FITS" if b.fits else "DOES NOT FIT"
        lines += ["", f"  peak {fmt_bytes(b.peak_bytes)} of {fmt_bytes(b.usable_bytes)} usable: {verdict} "
                      f"({fmt_bytes(abs(b.margin_bytes))} {'to spare' if b.fits else 'over'})"]
        if self.host is not None and (self.host.load or self.host.offload or self.host.staging):
            lines += ["", *self.host.lines()]
        if self.alternatives:
            head = "also fits" if self.fits else "alternative"
            lines += ["", f"  {head:<46} {'peak':>12} {'margin':>12}  fits"]
            for s in self.alternatives:
                peak = ("> " if not s.measured else "") + fmt_bytes(s.peak_bytes)
                lines.append(f"  {s.name:<46} {peak:>12} {fmt_bytes(s.margin_bytes, signed=True):>12}  "
                             f"{'yes' if s.fits else 'no '}" + (f"  ({s.note})" if s.note else ""))
            best = self.best_alternative()
            if not self.fits:
                lines.append("")
                lines.append(f"  most room: {best.name} ({fmt_bytes(best.margin_bytes)} to spare)" if best
                             else "  none of the alternatives tried fits")
        for n in self.notes:
            lines.append(f"  note: {n}")
        lines.append(f"  ({self.seconds:.1f}s)")
        return "\n".join(lines)


def device_lines(d: DeviceTerms) -> list[str]:
    """The GPU beyond the tensors, term by term (`plan.device`), down to what must fit."""
    comms = f"{d.n_communicators} communicator{'s' if d.n_communicators != 1 else ''}"
    return [f"  {'+ allocator':<14} {fmt_bytes(d.fragmentation):>12}  caching allocator replayed (expandable segments: a "
            "segment per stream, holes between blocks)",
            f"  {'+ cuBLAS':<14} {fmt_bytes(d.cublas):>12}  workspaces (2 handles x 32 MiB)",
            f"  {'= reserved':<14} {fmt_bytes(d.reserved):>12}  torch.cuda.max_memory_reserved()",
            f"  {'+ CUDA context':<14} {fmt_bytes(d.context):>12}  driver and kernels (lazy loading)",
            f"  {'+ NCCL':<14} {fmt_bytes(d.nccl):>12}  buffers ({comms})",
            f"  {'= on the GPU':<14} {fmt_bytes(d.total):>12}"]


def flat(snap: dict) -> dict[str, int]:
    """A tracker snapshot ({device: {category: bytes}}) as {category name: bytes}, summed over devices."""
    out: dict[str, int] = {}
    for dev_snap in snap.values():
        for k, v in dev_snap.items():
            name = str(getattr(k, "value", k))
            out[name] = out.get(name, 0) + v
    return out
