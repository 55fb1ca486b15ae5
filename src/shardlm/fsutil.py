"""Files that many processes share and a crash must not break: locks, pid liveness, staged writes.

- `FileLock`: a lock file made with O_EXCL (atomic on local filesystems, NFSv3+, Lustre and GPFS) that
  names its holder (host, pid and that pid's start time, when) and is kept fresh by a heartbeat. A holder
  is gone when, on this host, its pid is dead or now another process's (`pid_alive`), or, from another
  host, its lock had no heartbeat for `stale_s`: its lock is taken over with a note. A live holder is an
  error, or (`wait=True`) waited for. The run folders, the token-store cache and prepare's OUT use it.
- `staged(target)`: write beside `target`, then swap it in whole on success (the old one removed or kept
  under another name); a failure removes what was written and leaves `target` as it was.
- `swap_in`, `remove`, `free_name`: the pieces, for writers whose temp outlives one `with` (async saves).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from shardlm.errors import ConfigError

HEARTBEAT_S = 30.0  # a holder touches its lock this often
STALE_S = 120.0  # a lock from another host without a heartbeat for this long is a dead holder's


def proc_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (Linux: /proc/PID/stat field 22), to tell a live holder from a reused
    pid; None where it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int, start: str | None = None) -> bool:
    """Whether `pid` (on this host) is alive, and, given its recorded `start`, still the same process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return start is None or proc_start(pid) in (None, start)


# -- locks ----------------------------------------------------------------------------------------------
def _busy(lock: FileLock, holder: dict) -> Exception:
    return ConfigError(f"{lock.path} is held by {holder.get('host', '?')} pid {holder.get('pid', '?')}; wait for "
                       f"it to finish, or delete {lock.path} if that process is gone")


def _taken_over(lock: FileLock, why: str, holder: dict) -> str:
    return f"lock: taking over {lock.path} from a holder that is gone ({why})"


def _waiting(lock: FileLock, holder: dict) -> str:
    return f"lock: waiting for {holder.get('host', '?')} pid {holder.get('pid', '?')} to release {lock.path}"


def _dump(fd: int, record: dict) -> None:
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
        f.flush()  # a full disk fails here, inside the `with`, not at an unchecked close


class FileLock:
    """One holder at a time of `path`. `acquire()` (or `try_acquire()`) takes it, `release()` lets it go.

    What differs between its users are parameters: how often the heartbeat touches the lock, how old
    another host's lock must be to be stale, where notes go (`log`), the lines themselves (`busy(lock,
    holder)` -> the error for a live holder, `taken_over(lock, why, holder)` and `waiting(lock, holder)` ->
    a note), and `make_room()`: called once, holding the lock, when the disk is too full to write it.
    OSErrors of creating or writing the lock propagate: the caller names the folder and the fix."""

    def __init__(self, path: str | os.PathLike, *, log: Callable[[str], None] = print,
                 heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S,
                 make_room: Callable[[], None] | None = None,
                 busy: Callable[[FileLock, dict], Exception] = _busy,
                 taken_over: Callable[[FileLock, str, dict], str] = _taken_over,
                 waiting: Callable[[FileLock, dict], str] = _waiting):
        self.path, self.log = Path(path), log
        self.heartbeat_s, self.stale_s, self.make_room = heartbeat_s, stale_s, make_room
        self.busy, self.taken_over, self.waiting = busy, taken_over, waiting
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": proc_start(os.getpid()),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, *, wait: bool = False, until: Callable[[], bool] | None = None, poll_s: float = 0.5,
                tries: int | None = 3) -> bool:
        """Take the lock: True once it is ours. A gone holder's lock is taken over with a note (`tries`
        times at most, None: no limit; then False). A live holder raises `busy`, or with `wait` is waited
        for (one `waiting` note, a poll every `poll_s`) until it lets go or is gone; `until()` turning
        true (what the holder was making is there) ends the wait without the lock (False)."""
        said, took = False, 0
        while tries is None or took < tries:
            if until is not None and until():
                return False
            if self.try_acquire():
                return True
            holder = self.holder()
            if holder is None:
                continue  # released meanwhile: try again
            why = self.gone(holder)
            if why is not None:
                self.log(self.taken_over(self, why, holder))
                self.path.unlink(missing_ok=True)
                took += 1
                continue
            if not wait:
                raise self.busy(self, holder)
            if not said:
                self.log(self.waiting(self, holder))
                said = True
            time.sleep(poll_s)
        return False

    def try_acquire(self) -> bool:
        """Create the lock now, or False when it exists (whether its holder is alive or not)."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        self._write_record(fd)
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="shardlm-lock-heartbeat", daemon=True)
        self._thread.start()
        return True

    def _write_record(self, fd: int) -> None:
        """Our record into the lock we just created. A full disk: `make_room()` (the lock is ours, so what a
        dead holder left may go), then once more; failing that, no empty lock is left behind (it would look
        like a live holder's)."""
        try:
            try:
                _dump(fd, self.me)
            except OSError as e:
                if self.make_room is None or e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                self.make_room()
                _dump(os.open(self.path, os.O_WRONLY | os.O_TRUNC), self.me)
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise

    def holder(self) -> dict | None:
        """The holder's record plus `age` (seconds since its last heartbeat); {"age": ...} alone when the
        record cannot be read (being written, or garbage); None when there is no lock."""
        try:
            age = time.time() - self.path.stat().st_mtime
            record = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            record = {}
        return (record if isinstance(record, dict) else {}) | {"age": age}

    def gone(self, holder: dict) -> str | None:
        """Why `holder` is gone (its lock may be taken over), or None while it may be alive."""
        host, pid = holder.get("host", "?"), holder.get("pid")
        if host == self.me["host"] and isinstance(pid, int):
            return None if pid_alive(pid, holder.get("pid_start")) else f"pid {pid} on this host is gone"
        return f"no heartbeat from {host} for {holder['age']:.0f}s" if holder["age"] > self.stale_s else None

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours (not taken over meanwhile)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        try:
            if json.loads(self.path.read_text()).get("token") == self.me["token"]:
                self.path.unlink()
        except (OSError, ValueError, AttributeError):
            pass


# -- staged writes: write beside, swap in ---------------------------------------------------------------
def remove(path: Path) -> None:
    """Remove a file or a folder tree, if there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def free_name(folder: Path, stem: str, suffix: str = "") -> Path:
    """`folder/stem+suffix`, or the first free `folder/stem.N+suffix`: a name that keeps what is there."""
    path, n = folder / f"{stem}{suffix}", 0
    while path.exists():
        n += 1
        path = folder / f"{stem}.{n}{suffix}"
    return path


def swap_in(new: Path, target: Path, *, aside: Path | None = None, keep: Path | None = None) -> None:
    """Put `new` (a file or folder written beside `target`) in `target`'s place. A file replaces the old one
    atomically. An old folder is first renamed to `aside` (default `.NAME.old`) and removed after the
    swap: a crash between the two renames leaves it there whole, for the writer's next start to put back.
    `keep`: the old one (file or folder) stays, renamed to that path."""
    old = keep or aside or target.with_name(f".{target.name}.old")
    moved = target.exists() and (keep is not None or (target.is_dir() and not target.is_symlink()))
    if moved:
        target.rename(old)
    os.replace(new, target)
    if moved and keep is None:
        remove(old)


@contextlib.contextmanager
def staged(target: Path, *, tmp: Path | None = None, aside: Path | None = None, keep: Path | None = None,
           folder: bool = False) -> Iterator[Path]:
    """Yield a temp path beside `target` (default `.NAME.tmp`; a leftover there is removed first, and with
    `folder` it is made as an empty folder) to write into; when the block ends well it is swapped in
    (`swap_in`: `aside`, `keep`), on any exception (Ctrl-C too) it is removed and `target` is as it was.
    A kill leaves only the temp path."""
    tmp = tmp or target.with_name(f".{target.name}.tmp")
    remove(tmp)
    if folder:
        tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        remove(tmp)
        raise
    swap_in(tmp, target, aside=aside, keep=keep)


__all__ = ["HEARTBEAT_S", "STALE_S", "FileLock", "free_name", "pid_alive", "proc_start", "remove", "staged",
           "swap_in"]
