"""Where a step's time goes: a torch.profiler trace of chosen steps, and host time per phase of every step.

`StepProfiler` traces optimizer steps [start_step, start_step + steps) on every rank into
`<output_dir>/profile/rank{R}-steps{a}-{b}.json.gz` (a Chrome trace: open it in https://ui.perfetto.dev or
chrome://tracing; one `ProfilerStep#N` span per step). On CUDA it also records the allocator's history over
the same steps into `rank{R}-memory-steps{a}-{b}.pickle`, for https://pytorch.org/memory_viz.

`PhaseTimer` splits the step's host wall time into phases (data, compute, optimizer, checkpoint) and reports
their means per step for metrics.jsonl (`time_data_s`, `time_compute_s`, ...).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from shardlm import _torch_compat as compat
from shardlm.errors import ConfigError

MEMORY_MAX_ENTRIES = 100_000  # allocator events kept for the snapshot (a few KB each, with stacks)


def check_window(start_step: int, steps: int) -> None:
    """profile.start_step >= 1 and profile.steps >= 1, or one ConfigError line."""
    if start_step < 1:
        raise ConfigError(f"profile.start_step must be >= 1 (the first optimizer step to trace), got {start_step}")
    if steps < 1:
        raise ConfigError(f"profile.steps must be >= 1 (how many steps to trace), got {steps}")


class StepProfiler:
    """Traces optimizer steps [start_step, start_step + steps) on this rank; outside them it costs nothing.

    Call `step_begin(n)` before and `step_end(n)` after optimizer step n (1-based: the step being run), and
    `close()` when training ends (it writes what was traced when the run stops inside the window). A run
    resumed inside the window traces the rest of it; a step run again (a skipped non-finite step) gets a
    second span under the same number, except the window's last (the trace ends at its first end). The first
    traced step carries the profiler's start-up cost: on CUDA start after the warm-up steps (compile,
    allocator growth).
    """

    def __init__(self, output_dir: Path | str, start_step: int, steps: int, rank: int, device: torch.device,
                 log: Callable[[str], None] | None = None, memory: bool = True):
        check_window(start_step, steps)
        self.folder = Path(output_dir) / "profile"
        self.first, self.last = start_step, start_step + steps - 1
        self.rank, self.device, self.memory = rank, torch.device(device), memory
        self.log = log or (lambda line: None)
        self.prof: torch.profiler.profile | None = None
        self.span: torch.profiler.record_function | None = None
        self.began = self.ended = None
        self.recording_memory = False
        self.done = False

    @property
    def active(self) -> bool:
        return self.prof is not None

    def step_begin(self, step: int) -> None:
        if self.done or not self.first <= step <= self.last:
            return
        if self.prof is None:
            self.start(step)
        self.span = torch.profiler.record_function(f"ProfilerStep#{step}")
        self.span.__enter__()

    def step_end(self, step: int) -> None:
        if self.prof is None:
            return
        self.close_span()
        self.ended = step
        if step >= self.last:
            self.stop()

    def close(self) -> None:
        """Write what was traced (a run that ended inside the window); nothing once the window is done."""
        if self.prof is not None:
            self.stop()

    def start(self, step: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.memory and self.device.type == "cuda":
            self.recording_memory = compat.record_memory_history(MEMORY_MAX_ENTRIES)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self.prof.start()
        self.began = step

    def stop(self) -> None:
        """Stop tracing, write this rank's trace (and memory snapshot), say once where they are."""
        self.close_span()
        prof, self.prof, self.done = self.prof, None, True
        prof.stop()
        a, b = self.began, self.ended if self.ended is not None else self.began
        steps = f"steps{a}-{b}"
        prof.export_chrome_trace(str(self.folder / f"rank{self.rank}-{steps}.json.gz"))
        line = (f"profile: steps {a}-{b} traced into {self.folder}/rank*-{steps}.json.gz (one per rank; "
                "open in https://ui.perfetto.dev)")
        if self.recording_memory:
            compat.dump_memory_snapshot(str(self.folder / f"rank{self.rank}-memory-{steps}.pickle"))
            compat.stop_memory_history()
            self.recording_memory = False
            line += f"; CUDA memory: rank*-memory-{steps}.pickle (https://pytorch.org/memory_viz)"
        elif self.memory and self.device.type == "cuda":
            line += "; no CUDA memory snapshot: this torch has no torch.cuda.memory._record_memory_history"
        self.log(line)

    def close_span(self) -> None:
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None


PHASES = ("data", "compute", "optimizer", "checkpoint")


class PhaseTimer:
    """Host wall time per phase of the training step, as means per step (`time_<phase>_s`) over each interval.

    `mark()` starts the clock; `lap(phase)` adds the time since the last mark or lap to `phase`; `step()`
    counts a step; `record()` returns the means since the last record (0.0 for a phase without laps, e.g.
    `checkpoint` in an interval without a save: a save's time is spread over its interval's steps) and
    starts a new interval. Time between a lap and a later `mark()` is not counted anywhere.

    Host clock only. On CUDA the host only queues kernels and runs ahead until something waits for the
    device, so a phase's GPU work lands in whichever phase next synchronises. In the trainer that is the
    grad-norm `.item()` that ends `compute`: without a sync the optimizer's kernels (queued after it) are
    counted in the *next* step's `compute`, and `optimizer` is their launch time only. For an honest
    `optimizer`, give a `sync` (e.g. `torch.cuda.synchronize`) and end it with `lap("optimizer", sync=True)`:
    one device sync per step, which costs the overlap of the optimizer's kernels with the next step's data
    loading and launches. `sync` is not called where it is None (CPU, or the caller chose not to pay).
    """

    def __init__(self, phases: tuple[str, ...] = PHASES, sync: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.phases, self.sync, self.clock = tuple(phases), sync, clock
        self.totals = dict.fromkeys(self.phases, 0.0)
        self.steps = 0
        self.last = clock()

    def mark(self) -> None:
        """From now on: the time before this is not counted."""
        self.last = self.clock()

    def lap(self, phase: str, sync: bool = False) -> None:
        """The time since the last mark or lap was `phase` (after waiting for the device when `sync`)."""
        if phase not in self.totals:
            raise ValueError(f"unknown phase {phase!r}; the timer's phases are {', '.join(self.phases)}")
        if sync and self.sync is not None:
            self.sync()
        now = self.clock()
        self.totals[phase] += now - self.last
        self.last = now

    def step(self) -> None:
        self.steps += 1

    def record(self) -> dict[str, float | None]:
        """{time_<phase>_s: mean seconds per step} since the last record (None before any step), then reset."""
        n = self.steps
        out = {f"time_{p}_s": (t / n if n else None) for p, t in self.totals.items()}
        self.totals = dict.fromkeys(self.phases, 0.0)
        self.steps = 0
        return out


__all__ = ["MEMORY_MAX_ENTRIES", "PHASES", "PhaseTimer", "StepProfiler", "check_window"]
