"""`shardlm plot` (observe/plots.py): runs' metrics.jsonl -> one image, through the CLI in process; the
curves drawn are checked against the records (later line wins, malformed lines skipped and counted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from shardlm.cli import main
from shardlm.errors import ConfigError

pytest.importorskip("matplotlib")

from matplotlib.image import imread  # noqa: E402

from shardlm.observe.plots import make_figure, plot_runs, read_run, run_names  # noqa: E402


def _rec(step: int, elapsed: float, **kw) -> dict:
    return {"step": step, "loss": 4.0 - step / 100, "lr": 1e-3 * step / 40, "grad_norm": 1.0,
            "tokens_per_sec": 1000.0 + step, "mfu": None, "mem_gib": 0.5, "elapsed_s": elapsed, **kw}


def _write(folder: Path, lines: list) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                                                  for x in lines))
    return folder


@pytest.fixture
def two_runs(tmp_path) -> tuple[Path, Path]:
    # a: killed after step 30 (a torn last line), resumed from step 20, which it logs again; val every 20 steps
    a = _write(tmp_path / "x" / "run", [
        _rec(10, 1.0), _rec(20, 2.0, val_loss=3.9, val_ppl=49.4), _rec(30, 3.0), '{"step": 40, "lo',
        _rec(20, 0.5, loss=3.5, val_loss=3.8), {"event": "mixture", "shares": [1.0]},  # a non-step record
        _rec(30, 1.5), _rec(40, 2.5, val_loss=3.6)])
    b = _write(tmp_path / "y" / "run", [_rec(10, 2.0, mem_gib=1.5), "[1, 2]", _rec(20, 4.0, mem_gib=1.5)])
    return a, b


def test_read_run_later_line_wins_and_counts_malformed_lines(two_runs):
    run = read_run(two_runs[0])
    assert run.name == "run" and run.steps == [10, 20, 30, 40]
    assert run.values["loss"] == [3.9, 3.5, 3.7, 3.6]  # step 20 as the resumed run logged it
    assert run.series("val_loss") == ([20, 40], [3.8, 3.6])
    assert run.series("mfu") == ([], [])  # null everywhere: nothing to draw
    assert run.bad_lines == [4]
    # elapsed_s restarts at the resume: training time adds the segments (3.0 s before it)
    assert run.series("loss", "elapsed")[0] == [1.0, 3.5, 4.5, 5.5]


def test_names_tell_equal_folders_apart(tmp_path):
    assert run_names([tmp_path / "x" / "run", tmp_path / "y" / "run"]) == ["x/run", "y/run"]
    assert run_names([tmp_path / "a", tmp_path / "b" / "metrics.jsonl"]) == ["a", "b"]
    assert run_names([tmp_path / "a", tmp_path / "a"]) == ["a", "a (2)"]


def test_cli_writes_a_png_with_the_curves(two_runs, tmp_path, capsys):
    a, b = two_runs
    out = tmp_path / "plots" / "both.png"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    warnings = captured.err.strip().splitlines()
    assert warnings == [f"shardlm: warning: plot: skipped 1 malformed line of {a / 'metrics.jsonl'} (line 4)",
                        f"shardlm: warning: plot: skipped 1 malformed line of {b / 'metrics.jsonl'} (line 2)"]
    image = imread(out)
    height, width = image.shape[:2]
    assert 600 <= height <= 2000 and 900 <= width <= 2500 and image.shape[2] in (3, 4)
    assert image[..., :3].std() > 0.05  # not a blank canvas
    assert 20_000 < out.stat().st_size < 2_000_000
    assert [p.name for p in out.parent.iterdir()] == ["both.png"]  # no temporary file left


def test_figure_holds_each_runs_data(two_runs):
    runs = [read_run(p, n) for p, n in zip(two_runs, run_names(two_runs))]
    fig = make_figure(runs)
    loss, lr, tps, mem = fig.axes[:4]
    lines = {ax.get_title(): {ln.get_label(): ln for ln in ax.get_lines()} for ax in (loss, lr, tps, mem)}
    assert set(lines["loss"]) == {"x/run loss", "x/run val_loss", "y/run loss"}  # y has no val_loss
    val = lines["loss"]["x/run val_loss"]
    assert list(val.get_xdata()) == [20, 40] and list(val.get_ydata()) == [3.8, 3.6] and val.get_linestyle() == "--"
    assert val.get_color() == lines["loss"]["x/run loss"].get_color() != lines["loss"]["y/run loss"].get_color()
    assert list(lines["loss"]["x/run loss"].get_ydata()) == [3.9, 3.5, 3.7, 3.6]
    assert list(lines["throughput"]["y/run tokens_per_sec"].get_ydata()) == [1010.0, 1020.0]
    assert list(lines["memory"]["y/run mem_gib"].get_ydata()) == [1.5, 1.5]
    assert list(lines["learning rate"]["x/run lr"].get_xdata()) == [10, 20, 30, 40]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["x/run", "y/run"]
    assert mem.get_xlabel() == "step"

    fig = make_figure(runs, x="elapsed", log_loss=True)
    loss = fig.axes[0]
    assert loss.get_yscale() == "log" and fig.axes[3].get_xlabel() == "training time (s)"
    assert list(loss.get_lines()[0].get_xdata()) == [1.0, 3.5, 4.5, 5.5]


def test_default_out_and_names(two_runs, capsys):
    a, b = two_runs
    assert main(["plot", str(a), str(b), "--names", "base,lora", "--x", "elapsed"]) == 0
    assert capsys.readouterr().out.strip() == str(a / "plot.png")
    assert imread(a / "plot.png").shape[0] > 0


@pytest.mark.parametrize("setup, argv, needle", [
    (None, ["missing"], "plot: '{tmp}/missing' does not exist"),
    ("empty_dir", ["empty_dir"], "plot: '{tmp}/empty_dir' has no metrics.jsonl"),
    ("no_steps", ["no_steps"], "plot: '{tmp}/no_steps/metrics.jsonl' has no step records (1 malformed line)"),
    ("ok", ["ok", "--out", "{tmp}/p.bmpx"], "plot: cannot write '{tmp}/p.bmpx': the file name must end in one of"),
    ("ok", ["ok", "--names", "a,b"], "plot: 2 names for 1 runs"),
    ("ok", ["ok", "--x", "time"], "plot: argument --x: invalid choice: 'time'"),
])
def test_errors_are_one_line(tmp_path, capsys, setup, argv, needle):
    if setup == "empty_dir":
        (tmp_path / setup).mkdir()
    elif setup == "no_steps":
        _write(tmp_path / setup, ["garbage", {"event": "start"}])
    elif setup == "ok":
        _write(tmp_path / setup, [_rec(10, 1.0)])
    argv = [a.format(tmp=tmp_path) if "{" in a else str(tmp_path / a) if a in ("missing", setup) else a
            for a in argv]
    assert main(["plot", *argv]) == ConfigError.exit_code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardlm: error: ") and needle.format(tmp=tmp_path) in err[0], err


def test_without_matplotlib_the_error_names_the_extra(two_runs, monkeypatch, capsys, tmp_path):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=r"^`shardlm plot` needs matplotlib \(not installed\): "
                                          r"pip install 'shardlm\[viz\]'$"):
        plot_runs(two_runs, tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()
