"""The token store: `shardlm prepare` is deterministic whatever the workers, resumable after a kill, published
only when complete; a store holds exactly the tokenizer's ids; the cache prepares once and waits for others."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from shardlm.cli import main
from shardlm.data.sources import resolve_sources
from shardlm.data.store import cache as C, format as F, prepare as P
from shardlm.data.store.format import MANIFEST, TokenStore
from shardlm.data.store.prepare import PrepareSpec, ensure_cached_store, prepare
from shardlm.data.tokenizer import ByteTokenizer
from shardlm.errors import ConfigError, DataError
from shardlm.fsutil import FileLock, proc_start

HOST = socket.gethostname()


def _corpus(d: Path, n: int = 400) -> list[str]:
    """Documents over three kinds of file (several units each at chunk 1 KiB); returns the texts in order."""
    d.mkdir(parents=True, exist_ok=True)
    texts = [f"document {i}: " + "word " * (i % 17) + "end" for i in range(n)]
    third = n // 3
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:third]))
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in texts[third:2 * third]))
    for i, t in enumerate(texts[2 * third:]):
        (d / f"c{i:04d}.txt").write_text(t)
    return texts


def _spec(d: Path, **kw) -> PrepareSpec:
    return PrepareSpec(resolve_sources(str(d)), "bytes", ByteTokenizer.fingerprint, "text", chunk_bytes=1024, **kw)


def _tree(d: Path) -> dict[str, bytes]:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def test_one_and_two_workers_give_byte_identical_stores_holding_the_tokenizers_ids(tmp_path, monkeypatch):
    texts = _corpus(tmp_path / "src")
    logs: list[str] = []
    one = prepare(_spec(tmp_path / "src"), tmp_path / "one", workers=2, log=logs.append)
    assert logs[-1].endswith("with 1 worker"), "a small input is not worth a pool"
    monkeypatch.setattr(P, "POOL_BYTES_PER_WORKER", 1)
    two = prepare(_spec(tmp_path / "src"), tmp_path / "two", workers=2, log=logs.append)
    assert logs[-1].endswith("with 2 workers")
    assert _tree(tmp_path / "one") == _tree(tmp_path / "two")
    assert len(_tree(tmp_path / "one")) == 3 and not list(tmp_path.glob(".*partial"))
    # document by document: the tokenizer's ids, then EOS; in source order
    tok = ByteTokenizer()
    assert one.documents == len(texts) and one.manifest["tokens"] == sum(len(t.encode()) + 1 for t in texts)
    for d in (0, 1, len(texts) // 2, len(texts) - 1):
        doc = one.tokens[one.starts[d]:one.starts[d + 1]]
        assert doc.tolist() == tok.encode(texts[d]) + [tok.eos_id]
    assert one.manifest["tokenizer"]["fingerprint"] == "bytes-v1" and one.manifest["dtype"] == "uint16"
    one.verify()
    assert two.documents == one.documents


def test_a_killed_prepare_continues_on_rerun_and_equals_a_straight_one(tmp_path):
    _corpus(tmp_path / "src", n=600)
    straight = tmp_path / "straight"
    prepare(_spec(tmp_path / "src"), straight, workers=1, log=lambda _: None)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "shardlm", "prepare", str(tmp_path / "src"), str(out), "--workers", "1",
           "--chunk-mb", "1", "--data.tokenizer=bytes"]
    # --chunk-mb 1 plans other units than chunk_bytes=1024: prepare the straight one the same way
    subprocess.run([*cmd[:5], str(straight.with_name("straight_cli")), *cmd[6:]], check=True, capture_output=True)
    env = dict(os.environ, SHARDLM_TEST_PREPARE_SLEEP="0.4")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    parts = tmp_path / ".out.partial" / "parts"
    deadline = time.time() + 60
    while time.time() < deadline and len(list(parts.glob("*.json"))) < 1:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(parts.glob("*.json")))
    assert done >= 1 and not out.exists(), "killed midway: some parts done, no store published"
    rerun = subprocess.run(cmd, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming {tmp_path / '.out.partial'}: {done} of " in rerun.stdout
    assert _tree(out) == _tree(straight.with_name("straight_cli"))
    assert not (tmp_path / ".out.partial").exists()


def test_validation_split_is_by_content_disjoint_and_complete(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "POOL_BYTES_PER_WORKER", 1)  # a pool, even for this small input
    texts = _corpus(tmp_path / "src")
    store = prepare(_spec(tmp_path / "src", val_fraction=0.2, seed=3), tmp_path / "s", workers=2, log=lambda _: None)
    val = store.val()
    assert val is not None and val.manifest["split"] == "val" and store.manifest["val"] == {"fraction": 0.2, "seed": 3}

    def docs(s: TokenStore) -> list[str]:
        return [bytes(s.tokens[s.starts[d]:s.starts[d + 1] - 1].astype(np.uint8)).decode() for d in range(s.documents)]

    train_docs, val_docs = docs(store), docs(val)
    assert sorted(train_docs + val_docs) == sorted(texts)
    assert val_docs == [t for t in texts if P.in_val(t, 3, 0.2)] and 0.1 < len(val_docs) / len(texts) < 0.3
    other = prepare(_spec(tmp_path / "src", val_fraction=0.2, seed=4), tmp_path / "s4", workers=1, log=lambda _: None)
    assert docs(other.val()) != val_docs  # the seed chooses
    # --val PATH: a separate validation store from other files
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "v.txt").write_text("held out")
    sep = prepare(_spec(tmp_path / "src", val_files=[tmp_path / "v" / "v.txt"]), tmp_path / "sep", workers=1,
                  log=lambda _: None)
    assert sep.documents == len(texts) and docs(sep.val()) == ["held out"]


def test_a_validation_split_larger_than_training_is_a_warning(tmp_path, capsys):
    """--val-fraction 0.999 used to leave a store of a few training documents without a word."""
    _corpus(tmp_path / "src", n=60)
    capsys.readouterr()
    prepare(_spec(tmp_path / "src", val_fraction=0.2, seed=1), tmp_path / "ok", workers=1, log=lambda _: None)
    assert "warning" not in capsys.readouterr().err
    store = prepare(_spec(tmp_path / "src", val_fraction=0.999, seed=1), tmp_path / "s", workers=1,
                    log=lambda _: None)
    err = capsys.readouterr().err
    assert f"--val-fraction 0.999 left {store.documents} documents for training and put {store.val().documents} in " \
           "validation" in err, err


def test_existing_outputs_are_never_overwritten(tmp_path):
    _corpus(tmp_path / "src", n=30)
    logs: list[str] = []
    out = tmp_path / "out"
    prepare(_spec(tmp_path / "src"), out, workers=1, log=logs.append)
    before = _tree(out)
    prepare(_spec(tmp_path / "src"), out, workers=1, log=logs.append)
    assert logs[-1].startswith(f"prepare: {out} is already prepared (30 documents") and _tree(out) == before
    with pytest.raises(ConfigError, match="already holds a token store of other inputs"):
        prepare(_spec(tmp_path / "src", val_fraction=0.5), out, workers=1, log=logs.append)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not a token store"):
        prepare(_spec(tmp_path / "src"), tmp_path / "busy", workers=1, log=logs.append)
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine" and _tree(out) == before


def test_too_many_bad_records_publish_nothing_and_the_rerun_reuses_the_parts(tmp_path, capsys):
    d = tmp_path / "src"
    d.mkdir()
    (d / "a.jsonl").write_text('{"text": "good"}\nnot json\n{"body": "no text"}\n{"text": "fine"}\n')
    with pytest.raises(DataError, match=r"2 of 4 records are bad .*a.jsonl:2 .*a.jsonl:3"):
        prepare(_spec(d), tmp_path / "out", workers=1, log=lambda _: None)
    assert not (tmp_path / "out").exists() and list((tmp_path / ".out.partial" / "parts").glob("*.json"))
    store = prepare(_spec(d), tmp_path / "out2", workers=1, max_bad_fraction=0.5, log=lambda _: None)
    assert store.documents == 2 and store.manifest["bad_records"]["bad"] == 2
    assert "2 of 4 records" in capsys.readouterr().err


def test_a_damaged_or_foreign_store_is_one_clear_line(tmp_path):
    _corpus(tmp_path / "src", n=30)
    store = prepare(_spec(tmp_path / "src"), tmp_path / "s", workers=1, log=lambda _: None)
    with pytest.raises(ConfigError, match="was tokenised with bytes .* prepare the store with the run's tokenizer"):
        store.check_tokenizer(type("T", (), {"fingerprint": "hf-0123"})())
    tokens = tmp_path / "s" / "tokens.bin"
    data = tokens.read_bytes()
    tokens.write_bytes(data[:-2])
    with pytest.raises(DataError, match=r"tokens.bin is .* bytes, the manifest says .* \(a copy cut short\?\)"):
        TokenStore.open(tmp_path / "s")
    tokens.write_bytes(data[:-2] + b"\x01\x00")
    with pytest.raises(DataError, match="tokens.bin does not match its checksum"):
        TokenStore.open(tmp_path / "s").verify()
    assert main(["prepare", "--verify", str(tmp_path / "s")]) == 4  # DataError
    with pytest.raises(ConfigError, match="is not a token store"):
        TokenStore.open(tmp_path / "src")
    m = json.loads((tmp_path / "s" / MANIFEST).read_text())
    (tmp_path / "s" / MANIFEST).write_text(json.dumps({**m, "version": 99}))
    with pytest.raises(DataError, match="not a shardlm token store of version 1"):
        TokenStore.open(tmp_path / "s")


def test_the_cache_prepares_once_others_wait_and_a_dead_holder_is_taken_over(tmp_path):
    _corpus(tmp_path / "src", n=30)
    spec, cache = _spec(tmp_path / "src"), tmp_path / "cache"
    cache.mkdir()
    lock = cache / f"{spec.key()}.lock"
    # a live holder (this process, another thread): the caller waits until its store appears
    lock.write_text(json.dumps({"host": HOST, "pid": os.getpid()}))
    waited: list[str] = []

    def holder() -> None:
        time.sleep(0.5)
        prepare(spec, cache / spec.key(), workers=1, log=lambda _: None)
        lock.unlink()

    t = threading.Thread(target=holder)
    t.start()
    got = ensure_cached_store(spec, cache, log=waited.append, poll_s=0.05)
    t.join()
    assert got.documents == 30 and waited == [f"data: waiting for {HOST} pid {os.getpid()} to prepare "
                                              f"{cache / spec.key()}"]
    # a dead holder on this host: taken over at once
    spec2 = _spec(tmp_path / "src", seed=1, val_fraction=0.1)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (cache / f"{spec2.key()}.lock").write_text(json.dumps({"host": HOST, "pid": dead.pid}))
    logs: list[str] = []
    ensure_cached_store(spec2, cache, log=logs.append, poll_s=0.05)
    assert logs[0] == f"data: took over the preparation of {cache / spec2.key()} from a process that is gone"
    assert not (cache / f"{spec2.key()}.lock").exists()
    # a live pid that is not the holder any more (reused: another start time) is a dead holder too
    reused = cache / "reused.lock"
    reused.write_text(json.dumps({"host": HOST, "pid": os.getpid(), "pid_start": "0"}))
    notes: list[str] = []
    taker = FileLock(reused, log=notes.append)
    assert taker.acquire() and "is gone" in notes[0]
    taker.release()
    assert not reused.exists()
    reused.write_text(json.dumps({"host": HOST, "pid": os.getpid(), "pid_start": proc_start(os.getpid())}))
    with pytest.raises(ConfigError):
        FileLock(reused).acquire()
    # another host's lock is trusted until it is LOCK_STALE_S old
    spec3 = _spec(tmp_path / "src", seed=2, val_fraction=0.1)
    other = cache / f"{spec3.key()}.lock"
    other.write_text(json.dumps({"host": "node-7", "pid": 1}))
    with pytest.raises(ConfigError):
        FileLock(other, stale_s=C.LOCK_STALE_S).acquire()
    os.utime(other, (time.time() - C.LOCK_STALE_S - 5,) * 2)
    taker = FileLock(other, stale_s=C.LOCK_STALE_S, log=notes.append)
    assert taker.acquire() and "no heartbeat from node-7" in notes[1]
    taker.release()
    assert not other.exists()


def test_a_second_prepare_into_one_out_stops_with_one_line_and_leaves_the_first_ones_work(tmp_path, capsys):
    _corpus(tmp_path / "src", n=30)
    spec, out = _spec(tmp_path / "src"), tmp_path / "store"
    lock = tmp_path / ".store.prepare.lock"
    # a live prepare (this process stands in for it) holds OUT and has written part of its work
    lock.write_text(json.dumps({"host": HOST, "pid": os.getpid(), "pid_start": proc_start(os.getpid())}))
    work = F.partial_dir(out) / "parts"
    work.mkdir(parents=True)
    (work / "train-000000.json").write_text("being written")
    with pytest.raises(ConfigError, match=f"another shardlm prepare \\({HOST} pid {os.getpid()}\\) is writing "
                                          f"{out}; wait for it"):
        prepare(spec, out, workers=1, log=lambda _: None)
    assert (work / "train-000000.json").read_text() == "being written" and lock.exists() and not out.exists()
    # the CLI: one line, exit 2
    assert main(["prepare", str(tmp_path / "src"), str(out), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another shardlm prepare" in err and "Traceback" not in err
    # that prepare dies: its lock is taken over (its parts, of the same inputs, are resumed)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"host": HOST, "pid": dead.pid}))
    shutil.rmtree(F.partial_dir(out))
    logs: list[str] = []
    assert prepare(spec, out, workers=1, log=logs.append).documents == 30
    assert logs[0] == f"prepare: took over {out} from a prepare that is gone" and not lock.exists()


def _prepare_cli(args: list[str], capsys, fsize: int | None = None) -> tuple[int, str]:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, hard))
        rc = main(["prepare", *args, "--workers", "1"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    return rc, capsys.readouterr().err


def _big_corpus(d: Path) -> Path:
    """~3 MB of text in 12 files (12 units at chunk 1 MiB): the byte tokenizer's store is ~6 MB (uint16)."""
    d.mkdir()
    for i in range(12):
        (d / f"{i:02d}.txt").write_text("".join(f"line {i}.{j}: " + "abcdefghij" * 8 + "\n" for j in range(3000)))
    return d


def test_a_file_size_limit_in_prepare_is_one_line_and_the_rerun_continues(tmp_path, capsys):
    src, out = _big_corpus(tmp_path / "src"), tmp_path / "store"
    rc, err = _prepare_cli([str(src), str(out)], capsys, fsize=1 << 20)
    assert rc == 10 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"shardlm: error: prepare {out}: a file in {tmp_path} hit the file-size limit (ulimit -f: "
                          "1.05 MB"), err
    assert f"the finished parts in {tmp_path / '.store.partial'} are kept" in err and not out.exists()
    rc, err = _prepare_cli([str(src), str(out)], capsys)
    assert rc == 0 and TokenStore.open(out).documents == 12


def test_a_full_disk_in_prepare_names_the_disk_and_the_space_needed(tmp_path, capsys, small_disk):
    src, out = _big_corpus(tmp_path / "src"), small_disk.path / "store"
    small_disk.resize(4)  # some parts fit, not all of them (~6 MB), nor the store joined from them
    rc, err = _prepare_cli([str(src), str(out)], capsys)
    assert rc == 10 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"shardlm: error: prepare {out}: the disk of {small_disk.path} is full ({small_disk.path}: "
                          ), err
    need = float(re.search(r"needed ~([\d.]+) MB", err).group(1))
    assert 8 < need < 20, err  # parts + the store joined from them: ~2 x 6 MB
    parts = sorted((small_disk.path / ".store.partial" / "parts").glob("*.json"))
    assert parts and not (small_disk.path / ".store.partial" / "store").exists()
    small_disk.resize(32)
    rc, err = _prepare_cli([str(src), str(out)], capsys)
    assert rc == 0 and TokenStore.open(out).documents == 12


def test_abandoned_preparations_in_the_cache_are_removed_after_a_day_others_kept(tmp_path):
    _corpus(tmp_path / "src", n=10)
    spec, cache = _spec(tmp_path / "src"), tmp_path / "cache"
    old_time = time.time() - C.PARTIAL_STALE_S - 60
    dirs = {name: cache / f".{name}.partial" for name in ("old", "fresh", "locked", spec.key())}
    for name, d in dirs.items():
        (d / "parts").mkdir(parents=True)
        (d / "parts" / "train-000000.bin").write_bytes(b"x")
        if name != "fresh":
            for f in (d / "parts" / "train-000000.bin", d / "parts", d):
                os.utime(f, (old_time, old_time))
    (cache / "locked.lock").write_text("{}")
    logs: list[str] = []
    ensure_cached_store(spec, cache, log=logs.append)
    assert not dirs["old"].exists() and dirs["fresh"].exists() and dirs["locked"].exists()
    assert not dirs[spec.key()].exists()  # its own: continued (its bogus part replaced), then published
    assert logs[0] == f"data cache: removed 1 unfinished preparation of other inputs untouched for a day in {cache}"


def test_units_are_sized_from_the_input_only(tmp_path):
    (tmp_path / "small.jsonl").write_bytes(b"x" * 1000)
    assert P.auto_chunk_bytes([tmp_path / "small.jsonl"]) == P.MIN_CHUNK
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(640 << 20)  # sparse: 640 MiB -> units of 10 MiB
    assert P.auto_chunk_bytes([big]) == 10 << 20 and PrepareSpec([big], "bytes", "bytes-v1").chunk_bytes == 10 << 20


@pytest.mark.parametrize("verify", [False, True])
def test_damaged_store_bytes_stop_training_with_one_line(tmp_path, capsys, verify):
    """Token ids past the vocabulary (bytes damaged after the manifest was written) used to end in an IndexError
    traceback (a device-side assert on CUDA); every micro-batch is now checked, and data.verify=true runs the
    store's checksums before training starts."""
    _corpus(tmp_path / "src", n=60)
    prepare(_spec(tmp_path / "src"), tmp_path / "s", workers=1, log=lambda _: None)
    tokens = tmp_path / "s" / "tokens.bin"
    n = tokens.stat().st_size // 2  # uint16 ids (the byte tokenizer)
    tokens.write_bytes((1000).to_bytes(2, "little") * n)  # same size: opens; every id >= the debug model's 320
    environ = dict(os.environ)
    try:
        rc = main(["train", "--model.preset=debug", f"--data.path=store:{tmp_path / 's'}", "--data.seq_len=32",
                   "--train.micro_batch_size=2", "--train.steps=1", f"--train.output_dir={tmp_path / 'run'}",
                   "--metrics.progress_bar=false", "--checkpoint.save_final=false",
                   f"--data.verify={str(verify).lower()}"])
    finally:  # the run's env preset (flight recorder into this tmp_path) must not follow later tests
        os.environ.clear()
        os.environ.update(environ)
    err = capsys.readouterr().err
    assert rc == 4 and "Traceback" not in err, err  # DataError
    line = next(ln for ln in err.splitlines() if ln.startswith("shardlm: error"))
    if verify:
        assert "tokens.bin does not match its checksum" in line, err
    else:
        assert "token id 1000" in line and "outside the model's vocabulary (0..319)" in line, err


def test_a_store_whose_validation_split_is_gone_says_so(tmp_path):
    """Prepared with --val-fraction, val/ deleted: one line naming the store and the fix (it used to read as a
    store without a split: 'train on a store prepared with --val-fraction'); evaluation off: not needed."""
    from shardlm.config import load_config
    from shardlm.data.loader import open_val_store

    _corpus(tmp_path / "src", n=60)
    prepare(_spec(tmp_path / "src", val_fraction=0.2, seed=1), tmp_path / "s", workers=1, log=lambda _: None)
    shutil.rmtree(tmp_path / "s" / "val")
    with pytest.raises(DataError, match=f"{tmp_path / 's'} was prepared with --val-fraction 0.2, but its validation "
                                        f"store {tmp_path / 's' / 'val'} is missing or incomplete; prepare the store "
                                        "again"):
        TokenStore.open(tmp_path / "s").val()
    off = load_config(None, [f"--data.path=store:{tmp_path / 's'}", "--eval.at_end=false"])
    assert open_val_store(off.data, off.eval, ByteTokenizer()) is None
    prepare(_spec(tmp_path / "src"), tmp_path / "plain", workers=1, log=lambda _: None)
    assert TokenStore.open(tmp_path / "plain").val() is None  # none was made: none is asked for


def test_prepare_names_its_sources_and_refuses_a_token_store_as_one(tmp_path, capsys):
    _corpus(tmp_path / "src", n=30)
    prepare(_spec(tmp_path / "src"), tmp_path / "s", workers=1, log=lambda _: None)
    for src in (str(tmp_path / "s"), f"store:{tmp_path / 's'}"):
        assert main(["prepare", src, str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err == (f"shardlm: error: source {src!r} is a token store (already tokenized): train on it directly "
                       f"(data.path = \"store:{tmp_path / 's'}\"), or pass the raw files it was made from\n"), err
    assert main(["prepare", str(tmp_path / "nope.txt"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"shardlm: error: source '{tmp_path / 'nope.txt'}' does not exist; "
                                              "pass a file (")
    assert not (tmp_path / "out").exists()
