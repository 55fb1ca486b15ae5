"""`shardlm plot`: the curves of one or more runs' `metrics.jsonl` in one image (matplotlib, `[viz]`).

Four panels against the step (or the training time): loss (validation loss dashed, in the run's
colour), learning rate, tokens/s and peak memory; several runs are overlaid and named in one legend.

Reading is forgiving, because the file may come from a run that was killed or resumed: a line that is
not a JSON object is skipped and counted (one warning per file), an object without a `step` (a
non-step record) is ignored, and when a step appears twice (a resumed run logs it again) the later
line's values win. `elapsed_s` restarts at 0 when a run resumes; the time axis adds the segments up
(training time, not wall-clock time between the starts).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardlm.errors import ConfigError, say
from shardlm.extras import require
from shardlm.fsutil import staged

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# (metrics.jsonl key, panel title, y-axis label); the loss panel also draws `val_loss`
PANELS = (
    ("loss", "loss", "loss (nats per token)"),
    ("lr", "learning rate", "learning rate"),
    ("tokens_per_sec", "throughput", "tokens/s (all ranks)"),
    ("mem_gib", "memory", "peak memory (GiB)"),
)
X_AXES = ("step", "elapsed")
WHAT = "`shardlm plot`"


@dataclass
class Run:
    """One run's step records, in step order; `elapsed` is its training time, summed over restarts."""

    name: str
    path: Path
    steps: list[int] = field(default_factory=list)
    values: dict[str, list[float | None]] = field(default_factory=dict)
    elapsed: list[float | None] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """(xs, ys) of the steps that have a number for `key` (and for the x axis)."""
        xs = self.steps if x == "step" else self.elapsed
        pairs = [(a, b) for a, b in zip(xs, self.values.get(key, ())) if a is not None and b is not None]
        return [a for a, _ in pairs], [b for _, b in pairs]


def metrics_file(path: str | os.PathLike) -> Path:
    """The metrics.jsonl of a run folder (or the file itself), or a one-line ConfigError."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.exists():
        raise ConfigError(f"plot: {str(p)!r} does not exist; give a run's folder (its train.output_dir)")
    f = p / "metrics.jsonl"
    if not f.is_file():
        raise ConfigError(f"plot: {str(p)!r} has no metrics.jsonl; give a run's folder (its train.output_dir), "
                          "after it has logged a step")
    return f


def _number(v: Any) -> float | None:
    """A value to plot: None where there is none; a non-finite one is NaN (a gap in the line)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    return float(v) if math.isfinite(v) else math.nan


def read_run(path: str | os.PathLike, name: str | None = None) -> Run:
    """Read a run folder's metrics.jsonl (see the module docstring for what is skipped)."""
    f = metrics_file(path)
    run = Run(name or (f.parent.name if f.name == "metrics.jsonl" else f.stem), f)
    by_step: dict[int, dict[str, Any]] = {}
    offset = last = 0.0  # elapsed_s restarts at 0 in a resumed run: add up the segments
    for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict):
            run.bad_lines.append(n)
            continue
        step = rec.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            if step is not None:
                run.bad_lines.append(n)
            continue  # a record that is not a step's
        values = {k: _number(v) for k, v in rec.items() if k != "step"}
        if (e := values.get("elapsed_s")) is not None and math.isfinite(e):
            if e < last:
                offset += last
            last = e
            values["elapsed"] = e + offset
        by_step.setdefault(step, {}).update(values)
    if not by_step:
        bad = f" ({_lines(len(run.bad_lines))})" if run.bad_lines else ""
        raise ConfigError(f"plot: {str(f)!r} has no step records{bad}; has the run logged a step yet "
                          "(metrics.log_every)?")
    run.steps = sorted(by_step)
    keys = {k for rec in by_step.values() for k in rec}
    run.values = {k: [by_step[s].get(k) for s in run.steps] for k in keys}
    run.elapsed = run.values.pop("elapsed", [None] * len(run.steps))
    return run


def run_names(paths: Sequence[str | os.PathLike]) -> list[str]:
    """Folder names, with as many parent folders as it takes to tell equal ones apart."""
    parts = [Path(os.path.abspath(p)).parts for p in paths]
    parts = [p[:-1] if p[-1] == "metrics.jsonl" else p for p in parts]
    depth = 1
    while True:
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(set(parts)) or depth >= max(map(len, parts)):
            break
        depth += 1
    seen: dict[str, int] = {}
    out = []
    for name in names:  # the same folder twice
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name} ({seen[name]})")
    return out


def _time_unit(runs: Sequence[Run]) -> tuple[str, float]:
    longest = max((e for r in runs for e in r.elapsed if e is not None), default=0.0)
    return ("h", 3600.0) if longest >= 3 * 3600 else ("min", 60.0) if longest >= 180 else ("s", 1.0)


def make_figure(runs: Sequence[Run], x: str = "step", log_loss: bool = False) -> Figure:
    """The four panels for `runs` (no pyplot: a Figure with an Agg canvas, no global state)."""
    if x not in X_AXES:
        raise ConfigError(f"plot: x must be one of {', '.join(X_AXES)}, got {x!r}")
    require("matplotlib", "viz", WHAT)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter, LogFormatter

    fig = Figure(figsize=(12, 8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2, sharex=True).ravel()
    unit, scale = _time_unit(runs) if x == "elapsed" else ("", 1.0)
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for ax, (key, title, ylabel) in zip(axes, PANELS):
        drawn = False
        for run, colour in zip(runs, colours):
            drawn |= _draw(ax, run, key, x, scale, colour, "-")
            if key == "loss":
                drawn |= _draw(ax, run, "val_loss", x, scale, colour, "--")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="0.5")
    loss_ax, lr_ax, tps_ax, mem_ax = axes
    if log_loss:  # plain numbers (2, 3, 4), not 2x10^0
        loss_ax.set_yscale("log")
        loss_ax.yaxis.set_major_formatter(LogFormatter())
        loss_ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    tps_ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    for ax in (tps_ax, mem_ax):  # from zero: a 5% wobble should look like one
        if ax.has_data():
            ax.set_ylim(0, ax.get_ylim()[1] * 1.05)
    for ax in axes[2:]:
        ax.set_xlabel("step" if x == "step" else f"training time ({unit})")
    if any(run.series("val_loss", x)[0] for run in runs):
        loss_ax.legend(handles=[Line2D([], [], color="0.3", ls="-", label="train"),
                                Line2D([], [], color="0.3", ls="--", label="validation")], loc="upper right")
    fig.legend(handles=[Line2D([], [], color=c, lw=2.5, label=r.name) for r, c in zip(runs, colours)],
               loc="outside upper center", ncols=min(len(runs), 4), frameon=False, fontsize="large")
    return fig


def _draw(ax: Axes, run: Run, key: str, x: str, scale: float, colour: str, style: str) -> bool:
    xs, ys = run.series(key, x)
    if not xs:
        return False
    xs = [v / scale for v in xs]
    few = len(xs) <= 40  # sparse points (a short run, validation) get markers, so one point still shows
    ax.plot(xs, ys, color=colour, ls=style, lw=1.6, marker="o" if few else None, ms=3.5,
            label=f"{run.name} {key}", gid=f"{run.name}:{key}")
    return True


def _lines(n: int) -> str:
    return f"{n} malformed line" + "s" * (n != 1)


def _warn(line: str) -> None:
    say(f"shardlm: warning: {line}")


def plot_runs(run_dirs: Sequence[str | os.PathLike], out: str | os.PathLike, x: str = "step",
              names: Sequence[str] | None = None, log_loss: bool = False,
              warn: Callable[[str], None] = _warn) -> Path:
    """Draw the runs' curves into one image at `out` (format from its suffix; written atomically)."""
    if not run_dirs:
        raise ConfigError("plot: give at least one run folder")
    if names is not None and len(names) != len(run_dirs):
        raise ConfigError(f"plot: {len(names)} names for {len(run_dirs)} runs")
    out = Path(out)
    fmt = out.suffix[1:].lower()
    require("matplotlib", "viz", WHAT)  # before reading anything: the missing extra is the first thing said
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if fmt not in formats:
        raise ConfigError(f"plot: cannot write {str(out)!r}: the file name must end in one of "
                          f"{', '.join('.' + f for f in sorted(formats))}")
    runs = [read_run(p, n) for p, n in zip(run_dirs, names or run_names(run_dirs))]
    for run in runs:
        if run.bad_lines:
            shown = ", ".join(map(str, run.bad_lines[:5])) + (", ..." if len(run.bad_lines) > 5 else "")
            warn(f"plot: skipped {_lines(len(run.bad_lines))} of "
                 f"{run.path} (line {shown})")
    fig = make_figure(runs, x=x, log_loss=log_loss)
    out.parent.mkdir(parents=True, exist_ok=True)
    with staged(out, tmp=out.with_name(f".{out.name}.tmp-{os.getpid()}")) as tmp:
        fig.savefig(tmp, format=fmt)
    return out


__all__ = ["PANELS", "Run", "make_figure", "metrics_file", "plot_runs", "read_run", "run_names"]
