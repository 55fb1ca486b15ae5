"""The documentation stays true: the generated config reference, the mkdocs site, the README's length, the links."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)


def _config_docs():
    spec = importlib.util.spec_from_file_location("config_docs", ROOT / "scripts" / "config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_generated_from_the_field_docs():
    gen = _config_docs()
    assert gen.PAGE.read_text(encoding="utf-8") == gen.render(), \
        "docs/config.md is stale (the config's field docs changed): run `python scripts/config_docs.py --write`"


def test_config_reference_names_every_key():
    from shardlm.config import describe

    keys = re.findall(r"^  (\w+\.\w+) = ", describe(), re.M)
    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert keys and [k for k in keys if f"**`{k}`**" not in text] == []


def test_config_docs_check_says_how_to_fix_a_stale_page(tmp_path, monkeypatch, capsys):
    gen = _config_docs()
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    monkeypatch.setattr(gen, "PAGE", tmp_path / "docs" / "config.md")
    (tmp_path / "docs").mkdir()
    gen.PAGE.write_text("# old\n")
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["docs/config.md is stale (the config's field docs changed): run "
                   "`python scripts/config_docs.py --write`"]
    assert gen.main(["--write"]) == 0 and gen.main(["--check"]) == 0


def test_mkdocs_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the [docs] extra (pip install -e '.[docs]')")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def test_mkdocs_nav_lists_every_page():
    nav = set(re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    assert nav == {p.name for p in PAGES}


def test_readme_reads_in_one_sitting():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= 250, f"README.md has {n} lines (at most 250): move the detail into docs/"


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_relative_links_point_to_files_that_exist(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # no links in code blocks
    targets = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:|#", t)]
    missing = [t for t in targets if not (page.parent / t.split("#")[0]).exists()]
    assert missing == [], f"{page.name}: links to missing files {missing}"
