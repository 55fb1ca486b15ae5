"""A full disk, a quota or a file-size limit (ENOSPC, EDQUOT, EFBIG) as one line that names the disk.

Writers that know what they write (`shardlm prepare`, `convert`, a checkpoint save, the run lock) turn the
OSError into a `StorageError` with `disk_error(exc, folder, what, needed=...)`: the folder, its mount point,
the free and total space there (or the `ulimit -f` limit), how much was needed when known, and the fix.
The CLI turns any other such OSError into the same kind of line (`from_oserror`). Python ignores SIGXFSZ, so
a write past `ulimit -f` is an EFBIG error here, not a killed process.

Before a big write, `check_free(path, need, error)` is the one free-space check (the run folders, the HF
export): the writer passes its own line.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
from collections.abc import Callable
from pathlib import Path

from shardlm.errors import StorageError

DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def find_disk_oserror(exc: BaseException | None) -> OSError | None:
    """The ENOSPC/EDQUOT/EFBIG OSError in `exc`, its causes and contexts, an exception group's members, or
    the per-rank failures of DCP's CheckpointException (each rank's write error); None if there is none."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return e
        # Rust writers (safetensors) raise their own type: `... I/O error: File too large (os error 27)`
        m = re.search(r"\(os error (\d+)\)", str(e))
        if m and int(m.group(1)) in DISK_ERRNOS:
            return OSError(int(m.group(1)), os.strerror(int(m.group(1))))
        todo += [e.__cause__, e.__context__]
        todo += list(getattr(e, "exceptions", ()) or ())  # ExceptionGroup
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            for f in failures.values():
                todo.append(f[0] if isinstance(f, tuple) else f)  # (exception, traceback) or the exception
    return None


FULL_BELOW = 1 << 20  # a write failed with less free than this on its disk: the disk was full


def inferred_disk_oserror(folder: str | Path, written: str | Path | None = None) -> OSError | None:
    """For writers that lose the OSError (torch.save's zip writer turns a failed write into `unexpected pos`):
    EFBIG when a file under `written` reached the `ulimit -f` limit, ENOSPC when the disk of `folder` has
    less than FULL_BELOW free; else None. Call it right after the failure, before cleaning up."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if written is not None and soft != resource.RLIM_INFINITY and Path(written).is_dir():
        if any(f.is_file() and f.stat().st_size >= soft for f in Path(written).rglob("*")):
            return OSError(errno.EFBIG, os.strerror(errno.EFBIG))
    try:
        if free_bytes(folder) < FULL_BELOW:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError:
        pass
    return None


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def _existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int:
    """Free bytes on the disk of `path`, or of its nearest existing parent (a folder not made yet)."""
    return shutil.disk_usage(_existing(Path(path))).free


def check_free(path: str | Path, need_bytes: float, error: Callable[[int, Path], Exception]) -> int:
    """The one free-space check before a big write: raise `error(free, folder)` (the writer's own line;
    `folder`: `path` or its nearest existing parent, where it was measured) when the disk of `path` has less
    than `need_bytes` free; else return the free bytes."""
    folder = _existing(Path(path))
    free = shutil.disk_usage(folder).free
    if free < need_bytes:
        raise error(free, folder)
    return free


def mount_point(path: str | Path) -> Path:
    p = _existing(Path(path))
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def describe(exc: OSError, folder: str | Path, needed: int | None = None) -> str:
    """`no space left on the disk of FOLDER (MOUNT: F free of T[, needed ~N])` or the file-size limit."""
    folder = Path(folder)
    need = f", needed ~{gb(needed)}" if needed else ""
    if exc.errno == errno.EFBIG:
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        limit = "unlimited" if soft == resource.RLIM_INFINITY else gb(soft)
        return f"a file in {folder} hit the file-size limit (ulimit -f: {limit}{need})"
    try:
        usage = shutil.disk_usage(_existing(folder))
        where = f"{mount_point(folder)}: {gb(usage.free)} free of {gb(usage.total)}"
    except OSError:
        where = "free space unknown"
    full = "over its quota" if exc.errno == errno.EDQUOT else "full"
    return f"the disk of {folder} is {full} ({where}{need})"


def fix(exc: OSError, folder: str | Path) -> str:
    if exc.errno == errno.EFBIG:
        return "raise the limit (ulimit -f unlimited) or split the output"
    return f"free space on that disk or write to another one than {folder}"


def disk_cause(exc: BaseException, folder: str | Path, written: str | Path | None = None) -> OSError | None:
    """The full-disk OSError in `exc`, or (with `written`, the folder being written) the one the disk and the
    files show (`inferred_disk_oserror`); None when the failure was something else."""
    found = find_disk_oserror(exc)
    return found if found is not None or written is None else inferred_disk_oserror(folder, written)


def disk_error(exc: BaseException | None, folder: str | Path, what: str, needed: int | None = None,
               after: str = "", cause: OSError | None = None) -> StorageError | None:
    """`what: <describe>; <after; >fix` as a StorageError when `exc` holds a full-disk error (or `cause` is
    one, from `disk_cause`), else None. The free space is measured now."""
    os_err = cause if cause is not None else find_disk_oserror(exc)
    if os_err is None:
        return None
    then = f"; {after}" if after else ""
    return StorageError(f"{what}: {describe(os_err, folder, needed)}{then}; {fix(os_err, folder)}")


def from_oserror(exc: OSError) -> StorageError:
    """Any full-disk OSError the writers did not name: the file (when the OSError has it) and its disk."""
    name = exc.filename or "a file"
    folder = Path(exc.filename).parent if exc.filename else Path.cwd()
    return StorageError(f"writing {name}: {describe(exc, folder)}; {fix(exc, folder)}")


__all__ = ["DISK_ERRNOS", "check_free", "describe", "disk_cause", "disk_error", "find_disk_oserror", "free_bytes",
           "from_oserror", "gb", "inferred_disk_oserror", "mount_point"]
