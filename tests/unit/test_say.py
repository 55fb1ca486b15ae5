"""`shardlm.errors.say`: a rank's line and its newline leave in one write, so ranks sharing a log never splice
their lines (under PYTHONUNBUFFERED=1 `print()` writes the text and the newline separately)."""

from __future__ import annotations

import os
import subprocess
import sys

from shardlm.errors import say


class Writes:
    def __init__(self):
        self.writes, self.flushed = [], 0

    def write(self, s):
        self.writes.append(s)

    def flush(self):
        self.flushed += 1


def test_one_write_per_line_and_a_flush():
    w = Writes()
    say("shardlm: error: rank 1: step 5: its launcher is gone", w)
    assert w.writes == ["shardlm: error: rank 1: step 5: its launcher is gone\n"] and w.flushed == 1


def test_unbuffered_processes_do_not_splice_lines(tmp_path):
    """Two processes, PYTHONUNBUFFERED=1, one shared log: every line whole (print() splices some here)."""
    code = ("import sys\nfrom shardlm.errors import say\n"
            "for i in range(3000):\n    say(f'rank {sys.argv[1]} line {i} ' + 'x' * 60)\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "log", "w") as log:
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stderr=log, env=env) for r in (0, 1)]
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    lines = (tmp_path / "log").read_text().splitlines()
    assert len(lines) == 6000 and all(line.startswith("rank ") and line.endswith("x" * 60) for line in lines)
