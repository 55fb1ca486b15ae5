"""The import graph of `src/shardlm`: no circles, counting every import (a function-local one too: an import
moved into a function to dodge a circle still ties the two modules together)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the shardlm modules it imports (anywhere in the file); `from pkg import name` counts as pkg.name
    when that is a module, else as pkg."""
    files = {_module(p): p for p in (SRC / "shardlm").rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, `level - 1` packages up
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            graph[mod] |= {t for t in targets if t in files and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_finder_sees_a_circle_through_a_function_local_import(tmp_path, monkeypatch):
    pkg = tmp_path / "shardlm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from shardlm.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from shardlm import a\n")
    (pkg / "c.py").write_text("from . import b\n")
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
    graph = import_graph()
    assert graph["shardlm.a"] == {"shardlm.b"} and graph["shardlm.b"] == {"shardlm.a"}
    assert graph["shardlm.c"] == {"shardlm.b"}
    assert cycles(graph) == [["shardlm.a", "shardlm.b"]]


def test_no_import_circles_in_shardlm():
    graph = import_graph()
    assert len(graph) > 50 and graph["shardlm.train.trainer"]  # it read the package
    assert cycles(graph) == [], "modules that import each other (directly or round a circle)"


# DESIGN.md's layers, lowest first: an import goes down or sideways, never up. Modules DESIGN.md does not name
# sit where their imports put them: the package's face (`shardlm`: its version only) with errors, disk and extras
# beside config (they import only errors), the debug assets beside the commands that write them, `python -m
# shardlm` on top.
LAYERS = [["", "errors", "_torch_compat"], ["config", "fsutil", "disk", "extras"], ["models", "distributed"],
          ["quant", "lora", "data", "observe"], ["resolve", "parallel", "checkpoint", "interop"], ["build"],
          ["eval", "generate", "inference", "bench", "assets"], ["train"], ["plan"], ["cli"], ["__main__"]]
FLOOR = {name: i for i, names in enumerate(LAYERS) for name in names}


def _floor(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    if part not in FLOOR:
        raise AssertionError(f"{module}: not in LAYERS; place shardlm.{part} on a floor (DESIGN.md's order)")
    return FLOOR[part]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs if _floor(b) > _floor(a))


def test_the_layer_check_sees_an_import_from_a_higher_floor():
    assert upward_imports({"shardlm.data.store": {"shardlm.train.rundir", "shardlm.errors"},
                           "shardlm.train.rundir": {"shardlm.data.store"}}) == \
        ["shardlm.data.store -> shardlm.train.rundir"]


def test_no_module_imports_from_a_higher_layer():
    assert upward_imports(import_graph()) == []
