"""Which checkpoint each checkpoint descends from, and what that means for resume and pruning.

Rank 0 writes `checkpoint.json` into every checkpoint before it is published:

  {"format": 1, "id": "<hex>", "step": N, "seq": K, "parent": "<id>" | null, "ancestors": [ids],
   "saved_at": "...", "host": "...", "world_size": W, "global_batch": B,
   "schedule": {"steps": T, "anchor": [step, lr factor] | null},
   "tokenizer": {"spec": "...", "sha256": "..."}}

`seq` counts saves in the folder (the newest save has the highest), `parent` is the checkpoint the
saved state descends from (the previous save, or the checkpoint the run resumed from) and
`ancestors` all of them, nearest first. The rules (docs/checkpoints.md, "Rules"):

- The folder's *current lineage* is its most recent save and that save's ancestors. `resume=auto`
  loads the newest of them, and falls back only along them.
- A run that resumes (or starts fresh) in a folder moves every checkpoint that is not the one it
  resumed from or one of that one's ancestors to `branches/<stamp>/` with one line: another branch
  is never deleted, and never mistaken for this one by `auto`.
- Pruning (`checkpoint.keep_last`) deletes only older checkpoints of the current lineage, and never a
  branch point (an ancestor of a checkpoint kept in `branches/`).

Checkpoints without `checkpoint.json` (written before it existed) count as one lineage, by step.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from shardlm.checkpoint.layout import complete_checkpoints
from shardlm.fsutil import free_name

RECORD_FILE = "checkpoint.json"
BRANCHES = "branches"


@dataclass
class Schedule:
    """The LR schedule a checkpoint was saved under: train.steps then, and where its decay restarted after a
    resume that changed train.steps (`anchor`: (step, lr factor); see train/optim.lr_factor)."""

    steps: int
    anchor: tuple[int, float] | None = None

    @classmethod
    def from_json(cls, d: Any) -> Schedule | None:
        if not isinstance(d, dict) or not isinstance(d.get("steps"), int):
            return None
        a = d.get("anchor")
        return cls(d["steps"], (int(a[0]), float(a[1])) if isinstance(a, list) and len(a) == 2 else None)


@dataclass
class RunFacts:
    """What the run that saved a checkpoint records beside its lineage: read back by a resume (the schedule,
    the global batch), compared with the resuming run (the tokenizer, the data), shown to people (when, where).
    A field the file lacks or holds in another shape reads as None (an older checkpoint)."""

    world_size: int | None = None
    global_batch: int | None = None
    schedule: Schedule | None = None
    tokenizer: dict[str, str] | None = None  # {"spec", "sha256"}: TokenizerRef.checkpoint_record()
    data: list[dict[str, Any]] | None = None  # per source: {"source", documents, tokens, sha256}
    saved_at: str | None = None
    host: str | None = None

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        if self.schedule is not None:
            a = self.schedule.anchor
            d["schedule"] = {"steps": self.schedule.steps, "anchor": list(a) if a is not None else None}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunFacts:
        def typed(key: str, kind: type) -> Any:
            v = d.get(key)
            return v if isinstance(v, kind) and not isinstance(v, bool) else None

        return cls(typed("world_size", int), typed("global_batch", int), Schedule.from_json(d.get("schedule")),
                   typed("tokenizer", dict), typed("data", list), typed("saved_at", str), typed("host", str))


@dataclass
class Record:
    """One checkpoint's checkpoint.json (see the module docstring)."""

    id: str
    step: int
    seq: int
    parent: str | None = None
    ancestors: list[str] = field(default_factory=list)
    facts: RunFacts = field(default_factory=RunFacts)

    def to_json(self) -> str:
        return json.dumps({"format": 1, "id": self.id, "step": self.step, "seq": self.seq, "parent": self.parent,
                           "ancestors": self.ancestors, **self.facts.to_json()}, indent=1)

    @classmethod
    def read(cls, directory: Path) -> Record | None:
        """The record of a checkpoint folder; None if it has none or it can't be read (counted as legacy)."""
        try:
            d = json.loads((directory / RECORD_FILE).read_text())
            rec = cls(str(d["id"]), int(d["step"]), int(d["seq"]), d.get("parent"), list(d.get("ancestors", [])),
                      RunFacts.from_json(d))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return rec


def _step(p: Path) -> int:
    return int(p.name.split("-", 1)[1])


def records(folder: Path) -> dict[Path, Record | None]:
    """Every complete checkpoint directly in `folder` with its record (None: legacy or unreadable)."""
    return {p: Record.read(p) for p in complete_checkpoints(folder)}


def current_lineage(folder: Path) -> list[Path]:
    """The folder's most recent save and its ancestors present here, newest step first (see module doc)."""
    recs = records(folder)
    known = {p: r for p, r in recs.items() if r is not None}
    if not known:
        return sorted(recs, key=_step, reverse=True)
    head = max(known, key=lambda p: known[p].seq)
    members = set(known[head].ancestors) | {known[head].id}
    keep = [p for p, r in known.items() if r.id in members]
    legacy = [p for p, r in recs.items() if r is None and _step(p) < _step(head)]
    return sorted(keep + legacy, key=_step, reverse=True)


def lineage_of(folder: Path, start: Path) -> set[Path]:
    """`start` and those of its ancestors that are in `folder` (legacy ones: every older step)."""
    rec = Record.read(start)
    out = {start}
    for p, r in records(folder).items():
        if r is None:
            if _step(p) < _step(start):
                out.add(p)
        elif rec is not None and r.id in rec.ancestors:
            out.add(p)
    return out


def next_seq(folder: Path) -> int:
    """1 + the highest seq of any checkpoint in the folder, set-aside branches included."""
    seqs = [0]
    for d in [folder, *sorted((folder / BRANCHES).glob("*"))]:
        seqs += [r.seq for r in records(d).values() if r is not None]
    return max(seqs) + 1


def protected(folder: Path) -> set[Path]:
    """Checkpoints in `folder` that a set-aside branch descends from (its branch points)."""
    ids = set()
    for d in sorted((folder / BRANCHES).glob("*")):
        for r in records(d).values():
            if r is not None:
                ids.update(r.ancestors)
    return {p for p, r in records(folder).items() if r is not None and r.id in ids}


def set_aside(folder: Path, resumed: Path | None, log, failed: tuple[Path, ...] = ()) -> Path | None:
    """Move every checkpoint of `folder` outside `resumed`'s lineage to branches/<stamp>/ (rank 0).
    `failed`: newer checkpoints that `auto` could not load (said so in the line)."""
    if not folder.is_dir():
        return None
    keep = lineage_of(folder, resumed) if resumed is not None and resumed.parent == folder else set()
    others = [p for p in complete_checkpoints(folder) if p not in keep]
    if not others:
        return None
    dest = free_name(folder / BRANCHES, time.strftime("%Y%m%d-%H%M%S"))
    dest.mkdir(parents=True)
    for p in others:
        p.rename(dest / p.name)
    names = ", ".join(p.name + (" (could not be loaded)" if p in failed else "") for p in others)
    why = (f"resuming {resumed.name} starts a branch" if resumed is not None and resumed.parent == folder
           else "this run starts a new lineage here" if resumed is None else f"this run continues {resumed}")
    if failed and all(p in failed for p in others):
        why = f"resuming {resumed.name}"
    log(f"checkpoint: {why}; {names} (not its ancestors) moved to {dest}: kept, but checkpoint.resume=auto "
        "will not pick them (pass one as checkpoint.resume to go back; delete the folder when done)")
    return dest


def new_record(folder: Path, step: int, parent: Record | None, facts: RunFacts) -> Record:
    """The record of a save at `step` that descends from `parent` (None: the lineage's first save)."""
    ancestors = [parent.id, *parent.ancestors] if parent is not None else []
    full = replace(facts, saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), host=socket.gethostname())
    return Record(uuid.uuid4().hex, step, next_seq(folder), parent.id if parent else None, ancestors, full)
