"""The run folder: one run at a time (a lock), writable before step 1, and files a crash cannot break.

- `RunLock`: `<folder>/.shardlm.lock` created with O_EXCL by rank 0 and kept fresh by a heartbeat. A
  second run on the folder stops at once, naming the holder (host, pid, start time); a lock whose
  holder is gone (same host: its pid is dead; other host: no heartbeat for STALE_S) is taken over
  with a note. O_EXCL creation is atomic on local filesystems and NFSv3+, Lustre and GPFS.
- `check_writable`: every rank writes a probe file into the folders it will write, and the free space
  is compared with what one checkpoint takes, before any training.
- `write_config`: each start's resolved config.toml; the previous one, if different, is kept as
  `config.<stamp>.toml`.
- `prepare_metrics_file`: a half-written last line (kill, full disk) is dropped with a note.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

from shardlm.errors import ConfigError, ShardlmError
from shardlm.fsutil import pid_alive, proc_start

LOCK_FILE = ".shardlm.lock"
HEARTBEAT_S = 30.0  # the holder touches its lock this often
STALE_S = 120.0  # a lock from another host without a heartbeat for this long is a dead run's


class RunLock:
    """One run per folder: `acquire()` on rank 0 before anything is written there; `release()` at the end."""

    def __init__(self, folder: Path, log=print, what: str = "train.output_dir", make_room=None):
        self.folder, self.log, self.what = Path(folder), log, what
        self.make_room = make_room  # called once, holding the lock, when the disk is too full to write it
        self.path = self.folder / LOCK_FILE
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": proc_start(os.getpid()),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_or_fail()
                continue
            except OSError as e:
                raise _unwritable(e, self.folder, self.what) from None
            try:
                self._write(fd)
            except OSError as e:
                # A full disk. The O_EXCL create made the lock ours: clear what a dead run left, then write again;
                # failing that, no empty lock is left behind (it would look like a live run's).
                if self.make_room is None or e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    self.path.unlink(missing_ok=True)
                    raise _unwritable(e, self.folder, self.what) from None
                self.make_room()
                try:
                    self._write(os.open(self.path, os.O_WRONLY | os.O_TRUNC))
                except OSError as e2:
                    self.path.unlink(missing_ok=True)
                    raise _unwritable(e2, self.folder, self.what) from None
            self._thread = threading.Thread(target=self._beat, name="shardlm-lock-heartbeat", daemon=True)
            self._thread.start()
            return
        raise ConfigError(f"{self.what} {str(self.folder)!r}: could not take {self.path} (another run keeps "
                          "taking it); use another folder")

    def _write(self, fd: int) -> None:
        with os.fdopen(fd, "w") as f:
            json.dump(self.me, f)
            f.flush()  # a full disk fails here, inside the `with`, not at an unchecked close

    def _take_over_or_fail(self) -> None:
        try:
            holder = json.loads(self.path.read_text())
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return  # released meanwhile: try again
        except (OSError, ValueError):
            holder, age = {}, time.time() - self.path.stat().st_mtime
        host, pid = holder.get("host", "?"), holder.get("pid")
        if host == self.me["host"] and isinstance(pid, int):
            dead = None if pid_alive(pid, holder.get("pid_start")) else f"pid {pid} on this host is gone"
        else:
            dead = f"no heartbeat from {host} for {age:.0f}s" if age > STALE_S else None
        if dead is None:
            raise ConfigError(
                f"{self.what} {str(self.folder)!r} is in use by another run (host {host}, pid {pid}, started "
                f"{holder.get('started', '?')}, last heartbeat {age:.0f}s ago); wait for it to end or use another "
                f"folder (if that run is dead on another host, its lock goes stale after {STALE_S:.0f}s, or delete "
                f"{self.path})")
        self.log(f"run lock: taking over {self.path} from a run that is gone ({dead}; started "
                 f"{holder.get('started', '?')})")
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        try:
            if json.loads(self.path.read_text()).get("token") == self.me["token"]:
                self.path.unlink()
        except (OSError, ValueError):
            pass


def _unwritable(e: OSError, folder: Path, what: str, needed: int | None = None) -> ShardlmError:
    """A full disk (StorageError naming the disk), else a folder that cannot be written (ConfigError)."""
    from shardlm.disk import disk_error

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
    free = shutil.disk_usage(folder).free
    gib = 2**30
    if free < need_bytes * share:
        raise ConfigError(f"{what} {str(folder)!r} has {free / gib:.2f} GiB free, but one checkpoint needs "
                          f"~{need_bytes * share / gib:.2f} GiB here; free some space or point {what} elsewhere")
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
        kept = out / f"config.{stamp}.toml"
        n = 0
        while kept.exists():
            n += 1
            kept = out / f"config.{stamp}.{n}.toml"
        path.rename(kept)
    tmp = out / ".config.toml.tmp"
    tmp.write_text(text)
    tmp.replace(path)
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
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)
