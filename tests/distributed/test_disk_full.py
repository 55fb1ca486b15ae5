"""A full disk (ENOSPC, a real 16 MB tmpfs) or a file-size limit (EFBIG, `ulimit -f`) in a run, its restart and
its export: one line naming the disk and what was needed, exit 10, and nothing saved is lost.

One gloo rank per test runs the CLI in process (`shardlm.cli.main`, its stderr captured): the debug model
(0.87M params) writes ~10.5 MB per checkpoint (fp32 weights + two AdamW moments), so a 16 MB disk holds
step-2 and runs out while writing step-4.
"""

from __future__ import annotations

import contextlib
import io
import resource
import tempfile
from pathlib import Path

from helpers.launch import run_ranks


def _train(out: Path, ck: Path, corpus: str, steps: int = 4) -> list[str]:
    o = {"model.preset": "debug", "train.steps": steps, "train.output_dir": str(out), "checkpoint.dir": str(ck),
         "checkpoint.interval": 2, "checkpoint.async": False, "train.mixed_precision": "fp32",
         "train.micro_batch_size": 2, "data.path": corpus, "data.seq_len": 64,
         "data.cache_dir": str(out.parent / "cache"), "metrics.progress_bar": False, "train.sample_tokens": 0}
    return ["train", *(f"--{k}={v}" for k, v in o.items())]


def _cli(argv: list[str], fsize: int | None = None) -> tuple[int, str]:
    """main(argv) in this rank: (exit code, stderr); with `fsize`, under `ulimit -f fsize` bytes."""
    from shardlm.cli import main

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    with tempfile.TemporaryFile("w+") as err:  # a real file: the watchdog's faulthandler needs its fileno
        try:
            if fsize is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, hard))
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                rc = main(argv)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        err.seek(0)
        return rc, err.read()


def _listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def file_size_limit(tmp: str, corpus: str) -> dict:
    tmp_p = Path(tmp)
    out = {}
    # the first save (step-2, ~10.5 MB in one file) passes the 4 MB limit: nothing stands
    ck = tmp_p / "ck"
    out["train"] = _cli(_train(tmp_p / "run", ck, corpus), fsize=4 << 20)
    out["train_ck"] = _listing(ck)
    # the same run without the limit: step-2 and step-4; then an export past the limit
    out["train_ok"] = _cli(_train(tmp_p / "run", ck, corpus))
    out["export"] = _cli(["convert", "dcp-to-hf", str(ck / "step-4"), str(tmp_p / "hf")], fsize=1 << 20)
    out["export_dir"] = _listing(tmp_p)
    return out


def test_a_file_size_limit_in_a_save_and_an_export_is_one_line(tmp_path, corpus):
    out = run_ranks(1, file_size_limit, str(tmp_path), str(corpus))
    rc, err = out["train"]
    assert rc == 10 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"shardlm: error: checkpoint step-2: a file in {tmp_path / 'ck'} hit the file-size limit "
                          "(ulimit -f: 4.19 MB, needed ~"), err
    assert "the partial .step-2.partial was removed; no complete checkpoint stands yet; raise the limit" in err
    assert out["train_ck"] == []  # the partial that hit the limit is gone
    assert out["train_ok"][0] == 0, out["train_ok"]
    rc, err = out["export"]
    assert rc == 10 and err.count("\n") == 1, err
    assert f"export {tmp_path / 'hf'}: a file in {tmp_path} hit the file-size limit (ulimit -f: 1.05 MB" in err
    assert "nothing was written" in err and not any(n.startswith(("hf", ".hf")) for n in out["export_dir"])


def full_disk(tmp: str, corpus: str, disk: str) -> dict:
    from helpers.disk import SmallDisk

    tmp_p, small = Path(tmp), SmallDisk(Path(disk))
    ck, out = small.path / "ck", {}
    out["train"] = _cli(_train(tmp_p / "run", ck, corpus))
    out["after"] = _listing(ck)
    # a run killed while saving left a .step-4.partial that filled the disk: the restart removes it before it
    # probes the folder, then says that one checkpoint does not fit (not "fix its permissions")
    junk = ck / ".step-4.partial"
    junk.mkdir()
    with contextlib.suppress(OSError), open(junk / "__0_0.distcp", "wb") as f:
        while True:
            f.write(b"\0" * (1 << 20))
    out["restart"] = _cli(_train(tmp_p / "run", ck, corpus))
    out["after_restart"] = _listing(ck)
    # more space: the restart resumes from step-2 and finishes
    small.resize(48)
    out["resumed"] = _cli(_train(tmp_p / "run", ck, corpus))
    out["log"] = (tmp_p / "run" / "metrics.jsonl").read_text()
    out["final"] = _listing(ck)
    return out


def test_a_full_disk_mid_run_is_one_line_and_the_restart_is_not_blocked(tmp_path, corpus, small_disk):
    out = run_ranks(1, full_disk, str(tmp_path), str(corpus), str(small_disk.path))
    rc, err = out["train"]
    ck = small_disk.path / "ck"
    assert rc == 10 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"shardlm: error: checkpoint step-4: the disk of {ck} is full ({small_disk.path}: "), err
    assert " free of 16.78 MB, needed ~10." in err
    assert err.rstrip().endswith("the partial .step-4.partial was removed; the last complete checkpoint step-2 "
                                 f"stands; free space on that disk or write to another one than {ck}"), err
    assert out["after"] == ["step-2"]
    rc, err = out["restart"]
    assert rc == 2 and "one checkpoint needs" in err and "permissions" not in err, err
    assert out["after_restart"] == ["step-2"]
    assert out["resumed"][0] == 0, out["resumed"]
    assert out["final"] == ["step-2", "step-4"] or out["final"] == ["step-4"]
