"""The run folder: the one-run-per-folder lock, writability and free space, config.toml per start,
metrics.jsonl after a crash."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from shardlm.errors import ConfigError
from shardlm.fsutil import proc_start
from shardlm.train import rundir
from shardlm.train.rundir import LOCK_FILE, RunLock, check_writable, prepare_metrics_file, write_config


def _holder(path, **kw):
    d = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": proc_start(os.getpid()),
         "started": "2026-12-01 10:00:00 UTC", "token": "x", **kw}
    path.write_text(json.dumps(d))


def test_a_live_holder_stops_the_second_run_with_its_name(tmp_path):
    first = RunLock(tmp_path)
    first.acquire()
    with pytest.raises(ConfigError, match=rf"in use by another run \(host {socket.gethostname()}, pid {os.getpid()}, "
                                          r"started .*\); wait for it to end or use another folder"):
        RunLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    second = RunLock(tmp_path)
    second.acquire()  # free again
    second.release()


def test_a_dead_or_stale_holder_is_taken_over_with_a_note(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lines = []
    _holder(tmp_path / LOCK_FILE, pid=dead.pid, pid_start=None)
    lock = RunLock(tmp_path, log=lines.append)
    lock.acquire()
    assert f"pid {dead.pid} on this host is gone" in lines[0]
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == lock.me["token"]
    lock.release()
    # Our own pid, but another process start time: the pid was reused, the holder is gone.
    _holder(tmp_path / LOCK_FILE, pid_start="1")
    RunLock(tmp_path, log=lines.append).acquire()
    assert "is gone" in lines[1]
    (tmp_path / LOCK_FILE).unlink()
    # Another host: alive while its heartbeat is fresh, stale after STALE_S.
    _holder(tmp_path / LOCK_FILE, host="node-7", pid=1234)
    with pytest.raises(ConfigError, match=r"host node-7, pid 1234"):
        RunLock(tmp_path).acquire()
    old = time.time() - rundir.STALE_S - 5
    os.utime(tmp_path / LOCK_FILE, (old, old))
    RunLock(tmp_path, log=lines.append).acquire()
    assert "no heartbeat from node-7 for" in lines[2]


def test_release_leaves_a_lock_taken_over_by_another_run(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    _holder(tmp_path / LOCK_FILE, token="someone-else")
    lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "someone-else"


def test_unwritable_or_full_folders_fail_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.dir '/proc' is not writable \(.*\); fix its permissions"):
        check_writable(__import__("pathlib").Path("/proc"), "checkpoint.dir", 0)
    with pytest.raises(ConfigError, match=r"GiB free, but one checkpoint needs ~.* GiB here; free some space"):
        check_writable(tmp_path, "train.output_dir", 0, need_bytes=1 << 60)
    free = __import__("shutil").disk_usage(tmp_path).free
    warning = check_writable(tmp_path, "train.output_dir", 0, need_bytes=free * 2, share=0.25)
    assert warning.startswith("warning: train.output_dir") and "enough only if each node writes" in warning
    assert check_writable(tmp_path, "train.output_dir", 0, need_bytes=1) is None
    assert list(tmp_path.iterdir()) == []  # the probe is gone
    with pytest.raises(ConfigError, match=r"train.output_dir '/proc' is not writable"):
        RunLock(__import__("pathlib").Path("/proc")).acquire()  # the lock is the first write: the same line


def test_each_start_keeps_the_previous_different_config(tmp_path):
    assert write_config(tmp_path, "a = 1\n") is None
    assert write_config(tmp_path, "a = 1\n") is None  # the same: nothing to keep
    kept = write_config(tmp_path, "a = 2\n")
    assert kept.read_text() == "a = 1\n" and (tmp_path / "config.toml").read_text() == "a = 2\n"
    kept2 = write_config(tmp_path, "a = 3\n")
    assert kept2 != kept and kept2.read_text() == "a = 2\n" and kept.read_text() == "a = 1\n"


def test_a_cut_metrics_line_is_dropped_with_a_note(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "loss": 1.4}\n{"step": 4, "lo')
    notes = []
    prepare_metrics_file(tmp_path, 2, log=notes.append)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert len(notes) == 1 and "dropping line 4" in notes[0]
