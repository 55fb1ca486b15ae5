"""The data cache: raw files prepared into a token store once per content, once per shared filesystem.

`cached_store(key, cache_dir, build)` opens `<cache>/<key>/` when it is there; else the first process to take
`<cache>/<key>.lock` builds it (`build`: the prepare, `shardlm.data.store.prepare.ensure_cached_store`) while
the others wait for its manifest. This happens before the process group starts: no collective can time
out meanwhile. The lock is a `shardlm.fsutil.FileLock`: one whose holder is gone (same host: its pid is dead
or reused; another host: untouched for LOCK_STALE_S) is taken over.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Callable

from shardlm.data.store.format import MANIFEST, TokenStore
from shardlm.fsutil import FileLock


def default_cache_dir() -> Path:
    """Where data.path's files are prepared when data.cache_dir is unset (one store per content hash)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardlm" / "tokens"


LOCK_STALE_S = 120.0  # a lock from another host untouched this long is a dead preparer's
LOCK_REFRESH_S = 10.0


def cached_store(key: str, cache_dir: Path, build: Callable[[Path], TokenStore], *,
                 log: Callable[[str], None] = print, wait_log: Callable[[str], None] | None = None,
                 poll_s: float = 0.5) -> TokenStore:
    """The store `cache_dir/<key>/`: opened when it is there, else made by `build(out)` in whichever process
    takes the lock first while the others wait for it (no timeout: a stale lock is taken over). `log` is for
    the building process's lines, `wait_log` (default `log`) for a waiting one's."""
    wait_log = log if wait_log is None else wait_log
    cache_dir.mkdir(parents=True, exist_ok=True)
    if removed := remove_abandoned(cache_dir, keep=key):
        log(f"data cache: removed {removed} unfinished preparation{'s' if removed > 1 else ''} of other inputs "
            f"untouched for a day in {cache_dir}")
    out = cache_dir / key
    lock = FileLock(cache_dir / f"{key}.lock", log=wait_log, heartbeat_s=LOCK_REFRESH_S, stale_s=LOCK_STALE_S,
                    taken_over=lambda lock, why, h: f"data: took over the preparation of {out} from a process "
                    "that is gone",
                    waiting=lambda lock, h: f"data: waiting for {h.get('host', '?')} pid {h.get('pid', '?')} to "
                    f"prepare {out}")
    if lock.acquire(wait=True, until=lambda: (out / MANIFEST).is_file(), poll_s=poll_s, tries=None):
        try:
            if not (out / MANIFEST).is_file():
                return build(out)
        finally:
            lock.release()
    return TokenStore.open(out)


PARTIAL_STALE_S = 24 * 3600


def remove_abandoned(cache_dir: Path, keep: str) -> int:
    """Remove the unfinished preparations (`.<key>.partial/`) in the cache that nobody holds the lock of and
    nobody wrote to for PARTIAL_STALE_S (inputs that changed since: their parts would never be used); the
    one of `keep` stays (a rerun continues it). Returns how many."""
    removed, now = 0, time.time()
    for work in cache_dir.glob(".*.partial"):
        key = work.name[1:-len(".partial")]
        if key == keep or (cache_dir / f"{key}.lock").exists():
            continue
        try:
            newest = max([work.stat().st_mtime, *(f.stat().st_mtime for f in work.rglob("*"))])
        except FileNotFoundError:  # someone else is removing or publishing it
            continue
        if now - newest > PARTIAL_STALE_S:
            shutil.rmtree(work, ignore_errors=True)
            removed += 1
    return removed


__all__ = ["LOCK_REFRESH_S", "LOCK_STALE_S", "PARTIAL_STALE_S", "cached_store", "default_cache_dir",
           "remove_abandoned"]
