"""observe/profiler.py: a Chrome trace of exactly the chosen steps, and host time per phase of the step."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from shardlm.errors import ConfigError
from shardlm.observe.profiler import PhaseTimer, StepProfiler, check_window


def _train(prof: StepProfiler, steps: range, repeat: int | None = None) -> None:
    """A tiny model's optimizer steps, each between step_begin and step_end (`repeat`: run that step twice)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for n in steps:
        for _ in range(2 if n == repeat else 1):
            prof.step_begin(n)
            with torch.profiler.record_function(f"work{n}"):
                model(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            prof.step_end(n)


def _events(path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _names(events: list[dict], prefix: str) -> list[str]:
    return sorted(e["name"] for e in events if e.get("name", "").startswith(prefix) and e.get("ph") == "X")


def test_traces_exactly_the_window(tmp_path):
    lines = []
    prof = StepProfiler(tmp_path, start_step=2, steps=2, rank=1, device=torch.device("cpu"), log=lines.append)
    _train(prof, range(1, 6), repeat=2)  # step 2 runs twice (a skipped non-finite step): two spans
    prof.close()  # the window was done: writes nothing more
    assert [p.name for p in (tmp_path / "profile").iterdir()] == ["rank1-steps2-3.json.gz"]
    events = _events(tmp_path / "profile" / "rank1-steps2-3.json.gz")
    assert _names(events, "ProfilerStep#") == ["ProfilerStep#2", "ProfilerStep#2", "ProfilerStep#3"]
    assert _names(events, "work") == ["work2", "work2", "work3"]  # nothing of steps 1, 4, 5
    assert any(e.get("name") == "aten::addmm" for e in events)  # the ops themselves
    assert lines == [f"profile: steps 2-3 traced into {tmp_path}/profile/rank*-steps2-3.json.gz (one per rank; "
                     "open in https://ui.perfetto.dev)"]


def test_a_run_ending_or_resumed_inside_the_window_writes_what_ran(tmp_path):
    prof = StepProfiler(tmp_path, start_step=2, steps=10, rank=0, device="cpu")
    _train(prof, range(3, 5))  # resumed at step 2, stopped after step 4
    assert not (tmp_path / "profile" / "rank0-steps3-4.json.gz").exists()  # still inside the window
    prof.close()
    assert _names(_events(tmp_path / "profile" / "rank0-steps3-4.json.gz"), "ProfilerStep#") == [
        "ProfilerStep#3", "ProfilerStep#4"]


def test_a_run_past_the_window_writes_nothing(tmp_path):
    prof = StepProfiler(tmp_path, start_step=1, steps=2, rank=0, device="cpu")
    _train(prof, range(5, 7))
    prof.close()
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize(("start", "steps", "message"), [
    (0, 2, "profile.start_step must be >= 1 (the first optimizer step to trace), got 0"),
    (1, 0, "profile.steps must be >= 1 (how many steps to trace), got 0"),
])
def test_window_checks(start, steps, message):
    with pytest.raises(ConfigError) as e:
        check_window(start, steps)
    assert str(e.value) == message
    with pytest.raises(ConfigError):
        StepProfiler("unused", start, steps, rank=0, device="cpu")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_phase_timer_means_per_step():
    clock, syncs = Clock(), []
    timer = PhaseTimer(sync=lambda: syncs.append(clock.now), clock=clock)
    assert timer.record() == {"time_data_s": None, "time_compute_s": None, "time_optimizer_s": None,
                              "time_checkpoint_s": None}  # no step yet
    timer.mark()
    for n in (1, 2):
        clock.now += 0.1
        timer.lap("data")
        clock.now += 1.0
        timer.lap("compute")
        clock.now += 0.2
        timer.lap("optimizer", sync=True)
        if n == 2:
            clock.now += 4.0
            timer.lap("checkpoint")
        clock.now += 9.0  # logging: not a phase
        timer.mark()
        timer.step()
    assert timer.record() == pytest.approx({"time_data_s": 0.1, "time_compute_s": 1.0, "time_optimizer_s": 0.2,
                                            "time_checkpoint_s": 2.0})
    assert syncs == pytest.approx([1.3, 11.6])  # before the optimizer's clock reading, once per step
    clock.now += 1.0
    timer.lap("data")
    timer.step()
    assert timer.record() == pytest.approx({"time_data_s": 1.0, "time_compute_s": 0.0, "time_optimizer_s": 0.0,
                                            "time_checkpoint_s": 0.0})  # a new interval
    with pytest.raises(ValueError, match="unknown phase 'forward'"):
        timer.lap("forward")
