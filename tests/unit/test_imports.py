"""The import graph of `src/shardlm`: no circles, counting every import (a function-local one too: an import
moved into a function to dodge a circle still ties the two modules together); no import from a higher layer; and no
function-local import of a shardlm module without a `# lazy:` reason."""

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


# A function-local import of a shardlm module hides an edge of the import graph from a reader of the module's top,
# so it is allowed only with a reason on its line: `# lazy: ...` -- the module needs an optional extra (pyproject's
# extras: torchao, transformers, lm-eval, ...), or the import keeps torch (or another heavy import) out of a path
# that must stay light (`shardlm --help` builds every command's parser; prepare's torch-free worker processes).
LAZY_MARK = "# lazy:"

# Files exempt from the rule (none: keep it so).
NOT_YET_CLEANED: set[str] = set()


def _imports_shardlm(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        names = [node.module or ""] if not node.level else ["shardlm"]  # a relative import stays in the package
    else:
        names = [a.name for a in node.names]
    return any(n == "shardlm" or n.startswith("shardlm.") for n in names)


def local_imports(path: Path) -> list[int]:
    """The lines of `path`'s imports of shardlm modules that sit inside a function (any depth)."""
    found: list[int] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)) and _imports_shardlm(child):
                found.append(child.lineno)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def unmarked_local_imports(src: Path, skip: set[str] = frozenset()) -> list[str]:
    """`file:line: source` of each function-local shardlm import without a `# lazy:` reason on its (first) line."""
    bad = []
    for path in sorted((src / "shardlm").rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel in skip:
            continue
        lines = path.read_text().splitlines()
        bad += [f"{rel}:{n}: {lines[n - 1].strip()}" for n in local_imports(path) if LAZY_MARK not in lines[n - 1]]
    return bad


def test_the_lazy_check_sees_a_function_local_import_without_a_reason(tmp_path):
    pkg = tmp_path / "shardlm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from shardlm.b import g\n"                      # module level: fine
        "if TYPE_CHECKING:\n"
        "    from shardlm.c import C\n"                  # module level (an annotation): fine
        "def f():\n"
        "    import json\n"                              # not shardlm: fine
        "    from shardlm.b import h  # lazy: [hf] extra (transformers)\n"
        "    from shardlm.c import k\n"                  # no reason: reported
        "    class K:\n"
        "        def m(self):\n"
        "            from . import b\n"                  # relative, nested: reported
        "            import shardlm.d as d  # lazy: keeps torch out of `shardlm --help`\n")
    (pkg / "skipped.py").write_text("def f():\n    from shardlm import a\n")
    assert unmarked_local_imports(tmp_path, skip={"shardlm/skipped.py"}) == [
        "shardlm/a.py:8: from shardlm.c import k", "shardlm/a.py:11: from . import b"]
    assert "shardlm/skipped.py:2: from shardlm import a" in unmarked_local_imports(tmp_path)


def test_every_function_local_shardlm_import_says_why():
    assert all((SRC / f).is_file() for f in NOT_YET_CLEANED), "NOT_YET_CLEANED names a file that is gone"
    bad = unmarked_local_imports(SRC, NOT_YET_CLEANED)
    assert bad == [], ("move these imports to the module top, or end the line with `# lazy: <the extra it needs, or "
                       "the heavy import it keeps out of a light path>`:\n" + "\n".join(bad))


def long_functions(root: Path, limit: int = 80) -> list[str]:
    """`path:name (lines)` of every function or method under `root` longer than `limit` lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root)}:{node.name} ({n} lines)")
    return out


def test_the_length_check_sees_a_long_function(tmp_path):
    (tmp_path / "m.py").write_text("def short():\n    pass\n\n\ndef long():\n" + "    x = 1\n" * 80)
    assert long_functions(tmp_path) == ["m.py:long (81 lines)"]


def test_functions_stay_short_and_the_trainer_small():
    """The architecture step's limits (issue 29), kept: no function in src/ over 80 lines; train/trainer.py at
    most 450 lines (the run's operations live in train/session.py, what it says in observe/report.py)."""
    assert long_functions(SRC / "shardlm") == []
    trainer = SRC / "shardlm" / "train" / "trainer.py"
    assert len(trainer.read_text().splitlines()) <= 450
