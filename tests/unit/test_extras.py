"""The optional dependencies (shardlm.extras): a missing one is one line naming its extra, through the
real CLI; the commands that need none never import one (so never print their import noise)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from shardlm.cli import main
from shardlm.errors import ConfigError
from shardlm.extras import require

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug.toml")
EXTRAS = ("torchao", "transformers", "peft", "tensorboard", "matplotlib", "wandb")


def _block(monkeypatch, package: str) -> None:
    """Make `package` (and every submodule already imported) unimportable, as if not installed."""
    for name in [n for n in sys.modules if n.startswith(package + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, package, None)


def _the_error_line(capsys) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("shardlm: error: ")]
    assert "Traceback" not in err and len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    return errors[0]


def test_make_debug_hf_without_transformers_is_one_line(monkeypatch, capsys, tmp_path):
    _block(monkeypatch, "transformers")
    assert main(["make-debug-hf", str(tmp_path / "out")]) == 2
    assert _the_error_line(capsys) == ("shardlm: error: `shardlm make-debug-hf` needs transformers (not installed): "
                                       "pip install 'shardlm[hf]'")
    assert not (tmp_path / "out").exists()  # checked before anything is written


def _train(tmp_path, corpus, *overrides: str) -> list[str]:
    return ["train", "--config", DEBUG, "--train.steps=1", f"--train.output_dir={tmp_path / 'run'}",
            f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'cache'}", *overrides]


def test_train_with_tensorboard_but_without_it_is_one_line(monkeypatch, capsys, tmp_path, corpus):
    _block(monkeypatch, "tensorboard")
    assert main(_train(tmp_path, corpus, "--metrics.tensorboard=true")) == 2
    assert _the_error_line(capsys) == ("shardlm: error: metrics.tensorboard=true needs tensorboard (not installed): "
                                       "pip install 'shardlm[viz]'")


@pytest.mark.parametrize("command", ["train", "plan"])
def test_fp8_without_torchao_is_one_line(monkeypatch, capsys, tmp_path, corpus, command):
    _block(monkeypatch, "torchao")
    fp8 = ["--train.mixed_precision=fp8", "--train.fp8_emulate=true"]
    argv = (_train(tmp_path, corpus, *fp8) if command == "train"
            else ["plan", "--config", DEBUG, "--gpu-mem-gib", "80", *fp8])
    assert main(argv) == 2
    assert _the_error_line(capsys) == ("shardlm: error: train.mixed_precision=fp8 needs torchao (not installed): "
                                       "pip install 'shardlm[fp8]'")


def test_require_names_a_package_too_old_or_broken(monkeypatch, tmp_path):
    assert require("json", "x", "it") is sys.modules["json"]
    with pytest.raises(ConfigError, match=r"^it needs a newer json \(json\.nope is missing\): "
                                          r"pip install -U 'shardlm\[x\]'$"):
        require("json.nope", "x", "it")
    (tmp_path / "broken_extra.py").write_text("raise RuntimeError('built for another torch')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^it needs broken_extra, which is installed but fails to import "
                                          r"\(RuntimeError: built for another torch\)"):
        require("broken_extra", "x", "it")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_commands_without_extras_import_none(tmp_path, corpus):
    """presets, plan, train --help and a bf16/fp32 train never import an extra (torchao is slow and noisy)."""
    train = _train(tmp_path, corpus, "--train.sample_tokens=0")
    r = _run(f"""
import sys
from shardlm.cli import main
assert main(['presets']) == 0
assert main(['plan', '--config', {DEBUG!r}, '--gpu-mem-gib', '80']) == 0
assert main(['train', '--help']) == 0
assert main({train!r}) == 0
print('imported:', [m for m in {EXTRAS!r} if m in sys.modules])
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "imported: []"


NOISE = ("Failed to load", "is an Enum subclass", "Skipping import of cpp extensions")


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_fp8_imports_torchao_without_its_import_noise():
    r = _run(f"from shardlm.cli import main; main(['plan', '--config', {DEBUG!r}, '--gpu-mem-gib', '80', "
             "'--train.mixed_precision=fp8'])")
    assert r.returncode == 0 and "FITS" in r.stdout, r.stderr
    assert not [line for line in r.stderr.splitlines() if any(n in line for n in NOISE)], r.stderr


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_make_debug_hf_without_import_noise(tmp_path):
    r = _run(f"from shardlm.cli import main; main(['make-debug-hf', {str(tmp_path)!r}])")
    assert r.returncode == 0 and "wrote" in r.stdout, r.stderr
    assert not [line for line in r.stderr.splitlines() if any(n in line for n in NOISE)], r.stderr
