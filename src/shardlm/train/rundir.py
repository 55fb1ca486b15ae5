"""The run folder: one run at a time (a lock), writable before step 1, and files a crash cannot break.

- `RunLock`: `<folder>/.shardlm.lock`, an `fsutil.FileLock` (O_EXCL, heartbeat) taken by rank 0. A
  second run on the folder stops at once, naming the holder (host, pid, start time); a lock whose
  holder is gone (same host: its pid is dead; other host: no heartbeat for STALE_S) is taken over
  with a note.
- `check_writable`: every rank writes a probe file into the folders it will write, and the free space
  is compared with what one checkpoint takes, before any training.
- `write_config`: each start's resolved config.toml (written beside, swapped in); the previous one, if
  different, is kept as `config.<stamp>.toml`.
- `prepare_metrics_file`: a half-written last line (kill, full disk) is dropped with a note.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from shardlm.disk import check_free, disk_error
from shardlm.errors import ConfigError, ShardlmError
from shardlm.fsutil import HEARTBEAT_S, STALE_S, FileLock, free_name, staged

LOCK_FILE = ".shardlm.lock"


class RunLock:
    """One run per folder: `acquire()` on rank 0 before anything is written there; `release()` at the end.
    A `FileLock` with the run folder's lines; `make_room` is called once, holding the lock, when the disk
    is too full to write it."""

    def __init__(self, folder: Path, log=print, what: str = "train.output_dir", make_room=None):
        self.folder, self.what = Path(folder), what
        self.lock = FileLock(self.folder / LOCK_FILE, log=log, heartbeat_s=HEARTBEAT_S, stale_s=STALE_S,
                             make_room=make_room, busy=self._in_use, taken_over=self._taking_over)
        self.path, self.me = self.lock.path, self.lock.me

    def acquire(self) -> None:
        """Take the lock or raise the one line: a live run's, a folder that cannot be written, a full disk."""
        try:
            taken = self.lock.acquire()
        except OSError as e:
            raise _unwritable(e, self.folder, self.what) from None
        if not taken:
            raise ConfigError(f"{self.what} {str(self.folder)!r}: could not take {self.path} (another run keeps "
                              "taking it); use another folder")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours."""
        self.lock.release()

    def _in_use(self, lock: FileLock, holder: dict) -> ConfigError:
        return ConfigError(
            f"{self.what} {str(self.folder)!r} is in use by another run (host {holder.get('host', '?')}, pid "
            f"{holder.get('pid')}, started {holder.get('started', '?')}, last heartbeat {holder['age']:.0f}s ago); "
            f"wait for it to end or use another folder (if that run is dead on another host, its lock goes stale "
            f"after {lock.stale_s:.0f}s, or delete {lock.path})")

    def _taking_over(self, lock: FileLock, why: str, holder: dict) -> str:
        started = holder.get("started", "?")
        return f"run lock: taking over {lock.path} from a run that is gone ({why}; started {started})"


def _unwritable(e: OSError, folder: Path, what: str, needed: int | None = None) -> ShardlmError:
    """A full disk (StorageError naming the disk), else a folder that cannot be written (ConfigError)."""
    full = disk_error(e, folder, f"{what} {str(folder)!r}", needed=needed)
    if full is not None:
        return full
    return ConfigError(f"{what} {str(folder)!r} is not writable ({e.strerror or e}); fix its permissions or "
                       f"mount, or point {what} at a writable folder")


def check_writable(folder: Path, what: str, rank: int, need_bytes: int = 0, share: float = 1.0) -> str | None:
    """ConfigError if this rank cannot create and write files in `folder`, or if its free space is below
    `need_bytes * share` (this rank's node's share of one checkpoint). Returns a warning line when the
    free space is below `need_bytes` (a whole checkpoint, if the filesystem is shared), else None."""
    probe = folder / f".write-probe-{socket.gethostname()}-{os.getpid()}-{rank}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"shardlm")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        probe.unlink(missing_ok=True)
        raise _unwritable(e, folder, what, need_bytes * share or None) from None
    if need_bytes <= 0:
        return None
    gib = 2**30
    free = check_free(folder, need_bytes * share, lambda free, _: ConfigError(
        f"{what} {str(folder)!r} has {free / gib:.2f} GiB free, but one checkpoint needs "
        f"~{need_bytes * share / gib:.2f} GiB here; free some space or point {what} elsewhere"))
    if free < need_bytes:
        return (f"warning: {what} {str(folder)!r} has {free / gib:.2f} GiB free and one checkpoint is "
                f"~{need_bytes / gib:.2f} GiB in all: enough only if each node writes to its own disk")
    return None


def write_config(out: Path, text: str) -> Path | None:
    """Write this start's config.toml; an earlier, different one is kept as config.<stamp>.toml (returned)."""
    path = out / "config.toml"
    kept = None
    if path.is_file() and path.read_text() != text:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        kept = free_name(out, f"config.{stamp}", ".toml")
    with staged(path, keep=kept) as tmp:
        tmp.write_text(text)
    return kept


def prepare_metrics_file(out: Path, resumed_step: int | None, log=print) -> None:
    """Fresh run: keep an earlier metrics.jsonl aside. Resumed: drop the records after the checkpoint (the
    resumed run logs those steps again). Lines that aren't whole JSON records (a write cut by a kill or
    a full disk) are dropped with a note."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return
    if resumed_step is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        path.rename(out / f"metrics.{stamp}.jsonl")
        return
    keep = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError):
            log(f"metrics: dropping line {n} of {path}, not a whole record ({line[:40]!r}...): a write cut "
                "short by a kill or a full disk")
            continue
        if step <= resumed_step:
            keep.append(line)
    with staged(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in keep))


def write_run_files(out: Path, config_toml: str, resumed_step: int | None, log=print) -> None:
    """config.toml and metrics.jsonl, written once the run is known to start (a failed retry leaves the last
    one): a config that differs from the last start's keeps the old one aside; a resume cuts metrics.jsonl
    back to `resumed_step`."""
    if kept := write_config(out, config_toml):
        log(f"config: this start's config.toml differs from the last one, kept as {kept.name}")
    prepare_metrics_file(out, resumed_step, log=log)
