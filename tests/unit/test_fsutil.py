"""fsutil: the file lock (a dead holder is taken over, a live one refused or waited for) and staged writes
(a failed write leaves the old target as it was; a good one swaps in whole, keeping the old one on request)."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from shardlm.errors import ConfigError
from shardlm.fsutil import FileLock, free_name, proc_start, staged, swap_in


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _holder(path, **kw) -> None:
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                "pid_start": proc_start(os.getpid()), **kw}))


def test_a_dead_holder_is_taken_over_with_one_note(tmp_path):
    path, notes = tmp_path / "x.lock", []
    _holder(path, pid=_dead_pid())
    lock = FileLock(path, log=notes.append)
    assert lock.acquire()
    assert len(notes) == 1 and "is gone" in notes[0] and str(path) in notes[0]
    assert json.loads(path.read_text())["token"] == lock.me["token"]
    lock.release()
    assert not path.exists()


def test_a_live_holder_is_refused_with_its_line_and_its_lock_stays(tmp_path):
    path = tmp_path / "x.lock"
    first = FileLock(path)
    assert first.acquire()
    with pytest.raises(ConfigError, match=rf"held by {socket.gethostname()} pid {os.getpid()}"):
        FileLock(path).acquire()
    custom = FileLock(path, busy=lambda lock, h: RuntimeError(f"busy {h['pid']}"))
    with pytest.raises(RuntimeError, match=f"busy {os.getpid()}"):
        custom.acquire()
    assert json.loads(path.read_text())["token"] == first.me["token"]
    first.release()


def test_another_hosts_lock_is_live_until_its_heartbeat_is_stale(tmp_path):
    path = tmp_path / "x.lock"
    _holder(path, host="node-7", pid=1234)
    with pytest.raises(ConfigError, match="held by node-7 pid 1234"):
        FileLock(path, stale_s=60).acquire()
    old = time.time() - 61
    os.utime(path, (old, old))
    notes = []
    lock = FileLock(path, stale_s=60, log=notes.append)
    assert lock.acquire() and "no heartbeat from node-7 for" in notes[0]
    lock.release()


def test_a_waiter_gets_the_lock_when_the_holder_lets_go_or_stops_when_the_work_is_done(tmp_path):
    path, notes = tmp_path / "x.lock", []
    first = FileLock(path)
    assert first.acquire()
    threading.Timer(0.2, first.release).start()
    waiter = FileLock(path, log=notes.append, waiting=lambda lock, h: f"waiting on {h['pid']}")
    assert waiter.acquire(wait=True, poll_s=0.02)
    assert notes == [f"waiting on {os.getpid()}"]  # said once, however long the wait
    done = []
    threading.Timer(0.1, done.append, (True,)).start()
    assert not FileLock(path).acquire(wait=True, until=lambda: bool(done), poll_s=0.02)
    assert json.loads(path.read_text())["token"] == waiter.me["token"]
    waiter.release()


def test_release_keeps_a_lock_taken_over_by_someone_else(tmp_path):
    path = tmp_path / "x.lock"
    lock = FileLock(path)
    assert lock.acquire()
    _holder(path, token="someone-else")
    lock.release()
    assert json.loads(path.read_text())["token"] == "someone-else"


def test_a_lock_that_cannot_be_written_leaves_no_empty_lock(tmp_path):
    path, calls = tmp_path / "x.lock", []
    lock = FileLock(path, make_room=lambda: calls.append(1))

    def full(fd, record):
        os.close(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("shardlm.fsutil._dump", full)
        with pytest.raises(OSError, match="No space left"):
            lock.acquire()
    assert calls == [1] and not path.exists()  # room was made once, then the write failed again


def test_a_failed_staged_write_leaves_the_old_file_and_folder_as_they_were(tmp_path):
    target = tmp_path / "config.toml"
    target.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with staged(target) as tmp:
            tmp.write_text("half")
            raise KeyboardInterrupt
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "a").write_text("old")
    with pytest.raises(OSError):
        with staged(folder, folder=True) as tmp:
            (tmp / "a").write_text("half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert [p.name for p in folder.iterdir()] == ["a"] and (folder / "a").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml", "export"]


def test_a_staged_write_swaps_in_whole_and_keeps_the_old_one_on_request(tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "stale").write_text("old")
    with staged(folder, folder=True) as tmp:
        (tmp / "new").write_text("new")
    assert [p.name for p in folder.iterdir()] == ["new"]  # replaced whole, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # nothing left aside
    target = tmp_path / "config.toml"
    target.write_text("a")
    kept = free_name(tmp_path, "config.1", ".toml")
    with staged(target, keep=kept) as tmp:
        tmp.write_text("b")
    assert target.read_text() == "b" and kept.read_text() == "a"
    assert free_name(tmp_path, "config.1", ".toml").name == "config.1.1.toml"


def test_swap_in_a_folder_moves_the_old_one_aside_then_removes_it(tmp_path):
    final, new, aside = tmp_path / "step-4", tmp_path / ".step-4.partial", tmp_path / ".step-4.replaced"
    final.mkdir()
    (final / "old").write_text("old")
    new.mkdir()
    (new / "new").write_text("new")
    swap_in(new, final, aside=aside)
    assert [p.name for p in final.iterdir()] == ["new"] and not aside.exists() and not new.exists()
