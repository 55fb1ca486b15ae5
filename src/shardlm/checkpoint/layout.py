"""How checkpoints lie in a folder: `step-N` directories, complete once DCP's `.metadata` is in them.

The lowest layer of `shardlm.checkpoint`: the manager (save, load, publish) and the lineage record (which
checkpoints belong to this run) both read the folder through it."""

from __future__ import annotations

import re
from pathlib import Path

_STEP_RE = re.compile(r"^step-(\d+)$")
METADATA = ".metadata"


def step_of(path: Path) -> int | None:
    """N of a `step-N` directory; None for any other name."""
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def complete_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if step_of(p) is not None and (p / METADATA).is_file()]
    return sorted(found, key=step_of)
