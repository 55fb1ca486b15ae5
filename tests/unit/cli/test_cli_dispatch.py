"""The CLI dispatcher (`shardlm.cli.main`), in process: parsing, one-line errors, exit codes.

The real commands run as processes in tests/integration/test_cli.py; here the library functions
they call are replaced where running them would be slow.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from helpers.paths import ROOT

from shardlm import __version__
from shardlm.cli import COMMANDS, main
from shardlm.errors import PLAN_DOES_NOT_FIT, ConfigError

DEBUG = str(ROOT / "configs" / "debug.toml")


def _one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("shardlm: error: "), (out, err)
    return lines[0]


@pytest.mark.parametrize("argv", [["--help"], ["-h"]])
def test_help_lists_every_command(capsys, argv):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: shardlm <command>")
    for name in ("train", "prepare", "plan", "generate", "eval", "convert", "make-debug-hf", "presets", "env", "bench", "plot"):
        assert f"\n    {name}" in out
    assert set(COMMANDS) == {"train", "prepare", "plan", "generate", "eval", "convert", "make-debug-hf", "presets", "env", "bench", "plot"}


def test_no_command_prints_the_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "commands:" in capsys.readouterr().out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"shardlm {__version__}"


@pytest.mark.parametrize("argv, needle", [
    (["trian"], "unknown command 'trian'; commands: train, prepare, plan, generate, eval, convert, make-debug-hf, presets, env, bench, plot"),
    (["plan", "--nodes", "x", "--gpu-mem-gib", "80"], "plan: argument --nodes: invalid int value: 'x'"),
    (["plan", "--nodes", "2"], "plan: the following arguments are required: --gpu-mem-gib"),
    (["plan", "--gpu-mem-gib"], "plan: argument --gpu-mem-gib: expected one argument"),
    (["train", "--config"], "train: argument --config: expected one argument; see `shardlm train --help`"),
    (["--bogus"], "the following arguments are required: <command>"),
    (["convert"], "convert: the following arguments are required"),
    (["convert", "dcp-to-hf", "ckpt"], "convert dcp-to-hf: the following arguments are required: OUT"),
    (["convert", "dcp-to-hf", "a", "b", "--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
    (["make-debug-hf"], "make-debug-hf: the following arguments are required: OUT_DIR"),
    (["presets", "--model.preset=debug"], "presets: unrecognized arguments: --model.preset=debug"),
])
def test_usage_errors_are_one_config_error_line(capsys, argv, needle):
    assert main(argv) == ConfigError.exit_code == 2
    assert needle in _one_error_line(capsys)


def test_errors_go_to_the_torchelastic_error_file_and_only_rank0_prints(capsys, monkeypatch, tmp_path):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "1")
    assert main(["plan", "--nodes", "x", "--gpu-mem-gib", "80"]) == 2
    assert capsys.readouterr().err == ""
    message = json.loads(error_file.read_text())["message"]
    assert message.startswith("shardlm: error: plan: argument --nodes: invalid int value: 'x'")


def test_config_errors_keep_their_message(capsys):
    assert main(["train", "--config", DEBUG, "--train.stepz=5"]) == 2
    assert "unknown config key 'train.stepz'; did you mean 'train.steps'?" in _one_error_line(capsys)
    assert main(["train", "--config", "nowhere.toml"]) == 2
    assert "config file 'nowhere.toml' not found" in _one_error_line(capsys)


def test_train_help_prints_every_config_key(capsys):
    from shardlm.config import describe

    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: shardlm train [--config FILE] [--section.key=value ...]")
    assert describe() in out and "train.micro_batch_size" in out and "Sequences per rank" in out


class _FakeTrainer:
    made: list = []

    def __init__(self, cfg):
        self.cfg, self.trained, self.closed = cfg, False, False
        _FakeTrainer.made.append(self)

    def train(self):
        self.trained = True

    def close(self):
        self.closed = True


@pytest.mark.parametrize("config_args", [["--config", DEBUG], [f"--config={DEBUG}"]])
def test_train_overrides_reach_the_config(monkeypatch, config_args):
    import shardlm.train.trainer

    monkeypatch.setattr(shardlm.train.trainer, "Trainer", _FakeTrainer)
    _FakeTrainer.made.clear()
    argv = ["train", "--train.steps=7", *config_args, "--data.seq_len", "32", "--train.lr=2e-4"]
    assert main(argv) == 0
    (t,) = _FakeTrainer.made
    assert t.trained and t.closed
    assert t.cfg.train.steps == 7 and t.cfg.data.seq_len == 32 and t.cfg.train.lr == 2e-4
    assert t.cfg.model.preset == "debug"


def test_plan_passes_its_arguments_and_exits_3_when_it_does_not_fit(monkeypatch, capsys):
    import shardlm.plan

    calls = []

    def fake_plan(cfg, world_size, gpu_mem_gib, gpus_per_node, **kw):
        calls.append((cfg, world_size, gpu_mem_gib, gpus_per_node, kw))
        fits = gpu_mem_gib > 1
        return SimpleNamespace(fits=fits, format=lambda: f"fits={fits}", to_json=lambda: json.dumps({"fits": fits}))

    monkeypatch.setattr(shardlm.plan, "plan", fake_plan)
    assert main(["plan", "--nodes=2", "--gpus-per-node", "4", "--gpu-mem-gib=80", "--model.n_layers=3",
                 "--train.ac=full", "--train.cpu_offload=true", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"fits": True}
    cfg, world_size, mem, gpn, kw = calls[-1]
    assert (world_size, mem, gpn) == (8, 80.0, 4) and kw == {"alternatives": True, "exact": False}
    assert cfg.model.n_layers == 3 and cfg.train.ac == "full" and cfg.train.cpu_offload is True
    assert main(["plan", "--config", DEBUG, "--gpu-mem-gib", "0.5", "--headroom", "0.2", "--no-alternatives",
                 "--exact"]) == PLAN_DOES_NOT_FIT == 3
    assert capsys.readouterr().out.strip() == "fits=False"
    cfg, world_size, mem, gpn, kw = calls[-1]
    assert (world_size, gpn) == (8, 8) and kw == {"headroom": 0.2, "alternatives": False, "exact": True}


def test_presets_lists_every_preset(capsys):
    from shardlm.models import PRESETS

    assert main(["presets"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == list(PRESETS)


def test_convert_and_generate_say_the_same_of_a_path_that_is_no_checkpoint(capsys, tmp_path):
    """Exit 5 (checkpoint missing or incomplete, as the table in docs/concepts.md says) from every command, and
    the line says which: a path that does not exist is not reported as a missing .metadata."""
    ck = tmp_path / "checkpoints"
    (ck / "step-4").mkdir(parents=True)
    (ck / "step-4" / ".metadata").write_bytes(b"")
    (ck / "step-6").mkdir()  # a save that did not finish
    for argv in (["convert", "dcp-to-hf", "{}", str(tmp_path / "out")], ["generate", "--checkpoint", "{}", "--prompt", "hi"]):
        def run(path):
            assert main([a.format(path) for a in argv]) == 5, argv
            return _one_error_line(capsys)

        assert run(ck / "step-8") == f"shardlm: error: checkpoint {ck / 'step-8'} does not exist; pass a step-N " \
                                     f"directory ({ck} holds step-4)"
        assert run(ck / "step-6") == (f"shardlm: error: {ck / 'step-6'} is not a complete checkpoint (no .metadata: "
                                      "not a checkpoint, or a save that did not finish); pass a step-N directory "
                                      "that finished saving")
        assert run(ck) == f"shardlm: error: {ck} is a folder of checkpoints, not one; pass a step-N directory " \
                          f"({ck} holds step-4)"


def test_help_lists_every_exit_code_and_the_docs_agree(capsys):
    import re

    from shardlm.cli import main
    from shardlm.errors import EXIT_CODES, ConfigError, DataError, CheckpointError, PlanError, TrainingError

    assert {e.exit_code for e in (ConfigError, DataError, CheckpointError, PlanError, TrainingError)} <= set(EXIT_CODES)
    main(["--help"])
    out = capsys.readouterr().out
    for code, what in EXIT_CODES.items():
        assert f"{code:>3}  {what}" in out
    page = (ROOT / "docs" / "concepts.md").read_text()  # "Errors and exit codes"
    table = {int(m.group(1)) for m in re.finditer(r"^\| (\d+) \| ", page, re.M)}
    assert table == set(EXIT_CODES), (table, set(EXIT_CODES))
