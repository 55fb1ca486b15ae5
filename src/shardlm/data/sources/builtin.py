"""The built-in corpus `builtin:stdlib`: the running Python's standard library sources, on every machine,
no download. Its .py files are read whole, like .txt files; the few that are not UTF-8 (some of its test
files are Latin-1 or broken on purpose) are one note, not a warning (`skipped_line`)."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from shardlm.data.sources.text import TextReader

BUILTIN = "builtin:stdlib"


def stdlib_dir() -> Path:
    """The running Python's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_stdlib(path: str | Path) -> bool:
    """A .py file of the built-in corpus (its bad records are a note, not the user's data)."""
    return str(path).endswith(".py") and Path(path).is_relative_to(stdlib_dir())


def builtin_files(max_depth: int | None = None) -> list[Path]:
    """The running Python's standard library sources (.py; installed packages left out): on every
    machine, no download. In walk order: a folder's files sorted by name, then each subfolder (sorted)
    in full. `max_depth`: 0 = the top-level modules only, 1 = also the files one folder down, None = all.
    This is the one stdlib-corpus walker (the built-in corpus, the debug HF assets, tests, benchmarks).
    """
    root = stdlib_dir()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        if max_depth is not None and len(Path(dirpath).relative_to(root).parts) >= max_depth:
            dirnames[:] = []
        else:
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return files


def skipped_line(skipped: list[tuple[Path, str]], shown: int = 4) -> str:
    """One line for the files that are not UTF-8: a note for the stdlib's own (a few of its test files
    are Latin-1 or broken on purpose), a warning for the user's files, with the first `shown` named."""
    n = len(skipped)
    files = f"{n} file that is" if n == 1 else f"{n} files that are"
    more = f", and {n - shown} more" if n > shown else ""
    root = stdlib_dir()
    if all(f.is_relative_to(root) for f, _ in skipped):
        names = ", ".join(str(f.relative_to(root)) for f, _ in skipped[:shown])
        return f"shardlm: stdlib corpus: skipped {files} not UTF-8 ({names}{more})"
    names = ", ".join(f"{f} ({why})" for f, why in skipped[:shown])
    return f"shardlm: warning: skipped {files} not valid UTF-8 in data.path: {names}{more}"


class BuiltinReader(TextReader):
    """`builtin:stdlib`: the stdlib's .py files, each one text unit (not found in data.path's folders)."""

    suffixes = (".py",)
    listed = False
    names = (BUILTIN,)

    def files(self, spec: str) -> list[Path]:
        return builtin_files()
