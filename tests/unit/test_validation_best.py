"""A resumed run's final line names the best val_loss of the whole run: the part before the resume is read back
from metrics.jsonl (only up to the resume step; torn lines skipped)."""

from __future__ import annotations

import json

from shardlm.eval.validation import best_logged


def test_best_logged_reads_the_run_before_the_resume(tmp_path):
    f = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "val_loss": 2.5}, {"step": 4, "val_loss": 2.1},
             {"step": 6, "val_loss": 1.9}]
    f.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 7, "val_lo')
    assert best_logged(f, up_to=4) == (2.1, 4)
    assert best_logged(f, up_to=10) == (1.9, 6)
    assert best_logged(f, up_to=1) is None
    assert best_logged(tmp_path / "missing.jsonl", up_to=5) is None
