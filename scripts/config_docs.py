"""docs/config.md from the config's own field docs: every section and key with its type, default and doc.

The fields of `src/shardlm/config.py` carry their documentation (`field.metadata["doc"]`, what
`shardlm train --help` prints); this page is generated from them so the two never disagree.

    python scripts/config_docs.py            # print the page
    python scripts/config_docs.py --write    # rewrite docs/config.md
    python scripts/config_docs.py --check    # exit 1 (one line) when docs/config.md is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "config.md"
sys.path.insert(0, str(ROOT / "src"))  # document this checkout's config, whatever shardlm is installed

from shardlm import config as C  # noqa: E402

FIX = "python scripts/config_docs.py --write"

HEADER = f"""# Configuration reference

<!-- GENERATED from the field docs in src/shardlm/config.py by scripts/config_docs.py; do not edit by hand:
     run `{FIX}` (tests/unit/test_docs.py fails when this page is stale). -->

Every key of the config tree, section by section: its type, its default and what it does. Set a key in a
TOML file under its section (`[train]` then `steps = 200`) and pass the file with `--config FILE`, or
override it on the command line with `--train.steps=200` (or `--train.steps 200`). Unknown keys and wrong
types stop at once with one line that suggests the closest key. `shardlm train --help` prints the same
text; the resolved config of a run is written to `<output_dir>/config.toml` and loads back as is.
"""


def toml_value(value: typing.Any) -> str:
    """A default as it is written in a TOML file (`"debug"`, `true`, `[]`); None: the key is unset."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def escape(text: str) -> str:
    """Markdown-safe prose: `<output_dir>` and `*` outside code spans would be read as HTML or emphasis."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;").replace(">", "&gt;").replace("*", r"\*")
                   for p in parts)


def type_name(hint: typing.Any) -> str:
    """The type a key takes, as `shardlm train --help` names it (`int | 'auto'`, `bool`, `str | none`)."""
    bases, optional = C._type_args(hint)
    return " | ".join(map(C._type_name, bases)) + (" | none" if optional else "")


def default_of(f: dataclasses.Field) -> typing.Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def field_entry(dotted: str, f: dataclasses.Field, hint: typing.Any) -> list[str]:
    """One key: a heading line with type and default, then its doc."""
    return [f"**`{dotted}`** · `{type_name(hint)}` · default `{toml_value(default_of(f))}`", "",
            escape(f.metadata["doc"]), ""]


def table_entries(section: str, f: dataclasses.Field, hint: typing.Any) -> list[str]:
    """The keys of each entry of an array of tables (`[[data.sources]]`), numbered N from 0."""
    (inner,) = typing.get_args(hint)
    lines = [f"Each `[[{section}.{C._key(f)}]]` entry (`--{section}.{C._key(f)}.N.key=value` changes entry N):", ""]
    hints = typing.get_type_hints(inner)
    for sub in dataclasses.fields(inner):
        lines += field_entry(f"{section}.{C._key(f)}.N.{C._key(sub)}", sub, hints[sub.name])
    return lines


def section_lines(name: str, cls: type) -> list[str]:
    lines = [f"## [{name}]", ""]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        lines += field_entry(f"{name}.{C._key(f)}", f, hint)
        args = typing.get_args(hint)
        if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
            lines += table_entries(name, f, hint)
    return lines


def render() -> str:
    lines = [HEADER]
    for name, cls in C._sections().items():
        lines += section_lines(name, cls)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite {PAGE.relative_to(ROOT)}")
    mode.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    args = p.parse_args(argv)
    text = render()
    if args.write:
        PAGE.write_text(text, encoding="utf-8")
    elif args.check:
        if not PAGE.exists() or PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE.relative_to(ROOT)} is stale (the config's field docs changed): run `{FIX}`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
