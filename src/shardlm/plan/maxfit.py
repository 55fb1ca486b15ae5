"""`shardlm plan --max KEY`: the largest data.seq_len or train.micro_batch_size that fits, per GPU size.

A search over fake steps (`plan.measure`): the memory a GPU needs grows with either key, so for each GPU size the
answer is the last grid value whose plan fits. The search brackets it (the configured value, then doubling or
halving) and closes the bracket by interpolating the planned bytes (they are close to affine in either key:
activations and logits grow with the tokens), falling back to bisection; every plan measured is kept, so the
sizes of a row share their runs. data.seq_len moves in steps of 128 tokens, the micro-batch in steps of 1.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Callable

from shardlm.config import Config, set_value
from shardlm.errors import ConfigError
from shardlm.plan.report import GIB, fmt_bytes

KEYS = {"data.seq_len": (128, 1 << 21), "train.micro_batch_size": (1, 4096)}  # key -> (grid step, upper cap)
MAX_PLANS = 40  # fake steps per search at most (each a few seconds for an 8B model)


@dataclass
class MaxRow:
    gpu_mem_gib: float
    usable_bytes: int
    value: int | None  # the largest that fits; None when even the smallest does not
    peak_bytes: int | None  # the plan's GPU total at `value`
    capped: bool = False  # `value` is the search's upper cap: larger may fit too


@dataclass
class MaxReport:
    key: str
    model: str
    world_size: int
    configured: int
    rows: list[MaxRow]
    plans: dict[int, int] = field(default_factory=dict)  # value -> planned GPU bytes, every plan run
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    cp: int = 1  # the parallel.cp of `cp_rows`, the same search with context parallelism (1: none was run)
    cp_rows: list[MaxRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"key": self.key, "model": self.model, "world_size": self.world_size, "configured": self.configured,
                "rows": [dataclasses.asdict(r) for r in self.rows], "plans": {str(k): v for k, v in self.plans.items()},
                "notes": self.notes, "seconds": round(self.seconds, 2),
                "with_cp": {"cp": self.cp, "rows": [dataclasses.asdict(r) for r in self.cp_rows]} if self.cp_rows
                else None}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def format(self) -> str:
        lines = [f"shardlm plan --max {self.key}: {self.model} on {self.world_size} rank(s) (configured: "
                 f"{self.key}={self.configured:,})", "",
                 f"  {'GPU':>10}  {'largest ' + self.key:>24}  {'on the GPU at it':>16}  {'of usable':>12}"]
        lines += _row_lines(self.rows)
        if self.cp_rows:
            lines += ["", f"  with parallel.cp={self.cp} (each sequence split over {self.cp} ranks; same ranks):",
                      *_row_lines(self.cp_rows)]
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(f"  ({len(self.plans)} plans, {self.seconds:.1f}s)")
        return "\n".join(lines)


def _row_lines(rows: list[MaxRow]) -> list[str]:
    lines = []
    for r in rows:
        if r.value is None:
            lines.append(f"  {r.gpu_mem_gib:>6g} GiB  {'none fits':>24}")
            continue
        val = f"{'>= ' if r.capped else ''}{r.value:,}"
        lines.append(f"  {r.gpu_mem_gib:>6g} GiB  {val:>24}  {fmt_bytes(r.peak_bytes):>16}  "
                     f"{fmt_bytes(r.usable_bytes):>12}")
    return lines


def _grid(key: str, v: int) -> int:
    step = KEYS[key][0]
    return max(step, v // step * step)


def largest_fitting(cfg: Config, key: str, sizes_gib: list[float], headroom: float,
           measure: Callable[[Config], int]) -> tuple[list[MaxRow], dict[int, int]]:
    """The largest grid value of `key` whose planned GPU bytes (`measure(variant)`) fit each size's usable memory,
    and every plan run (value -> bytes)."""
    if key not in KEYS:
        raise ConfigError(f"plan --max: {key} is not searchable; use one of {', '.join(KEYS)}")
    step, cap = KEYS[key]
    section, name = key.split(".")
    plans: dict[int, int] = {}

    def need(v: int) -> int:
        if v not in plans:
            if len(plans) >= MAX_PLANS:
                raise ConfigError(f"plan --max {key}: no answer after {MAX_PLANS} plans")
            variant = copy.deepcopy(cfg)
            set_value(variant, key, v)
            plans[v] = measure(variant)
        return plans[v]

    start = _grid(key, getattr(getattr(cfg, section), name))
    rows = []
    for size in sizes_gib:
        usable = int(size * (1 - headroom) * GIB)
        lo, hi = _bracket(lambda v: need(v) <= usable, plans, usable, start, step, cap, key)
        if lo is not None and hi is not None:
            lo = _close(lambda v: need(v) <= usable, plans, usable, lo, hi, step, key)
        rows.append(MaxRow(size, usable, lo, plans.get(lo), capped=lo is not None and hi is None))
    return rows, plans


def _bracket(fits, plans, usable, start, step, cap, key) -> tuple[int | None, int | None]:
    """(lo, hi): lo fits and hi does not (hi None: the cap fits; lo None: the smallest grid value does not)."""
    lo = max((v for v, b in plans.items() if b <= usable), default=None)
    hi = min((v for v, b in plans.items() if b > usable), default=None)
    if lo is None and hi is None:
        lo, hi = (start, None) if fits(start) else (None, start)
    while hi is None and lo < cap:  # double until it does not fit
        nxt = min(cap, lo * 2)
        lo, hi = (nxt, None) if fits(nxt) else (lo, nxt)
    while lo is None and hi > step:  # halve until it fits
        nxt = _grid(key, hi // 2)
        lo, hi = (nxt, hi) if fits(nxt) else (None, nxt)
    return lo, hi


def _close(fits, plans, usable, lo, hi, step, key) -> int:
    """The largest grid value in [lo, hi) that fits: interpolate the planned bytes (nearly affine), then check the
    next grid value; bisect where the guess leaves the bracket."""
    while hi - lo > step:
        guess = lo + (usable - plans[lo]) * (hi - lo) / max(plans[hi] - plans[lo], 1)
        v = _grid(key, int(guess))
        if not lo < v < hi:
            v = _grid(key, (lo + hi) // 2)
            if not lo < v < hi:
                break
        if fits(v):
            lo = v
            if lo + step < hi and not fits(lo + step):
                hi = lo + step
        else:
            hi = v
    return lo
