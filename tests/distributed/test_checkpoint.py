"""DCP checkpoints on real gloo groups: exact resume, resharding N -> M ranks, async saves, safety."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest
from helpers.launch import run_ranks
from helpers.runs import checksums, train_then

STEPS, HALF = 12, 6


def _overrides(out, corpus, cache, mbs, steps=STEPS, **extra):
    o = {"model.preset": "debug", "train.steps": steps, "train.output_dir": str(out),
         "train.mixed_precision": "fp32", "train.micro_batch_size": mbs, "train.lr": 3e-3, "train.warmup_steps": 3,
         "data.path": str(corpus), "data.seq_len": 64, "data.cache_dir": str(cache), "metrics.log_every": 1,
         "metrics.progress_bar": False}
    o.update(extra)
    return [f"--{k}={v}" for k, v in o.items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("ckpt")
    cache = tmp / "cache"
    ck = tmp / "half4" / "checkpoints" / f"step-{HALF}"

    def resumed(name, mbs, **extra):  # a run from half4's step-6, on other ranks or another mesh
        return _overrides(tmp / name, corpus, cache, mbs=mbs, **{"checkpoint.resume": str(ck), **extra}), None

    res = {}
    # 4 ranks: one straight 12-step run, a 6-step run that saves its final state, and its resume on a 2x2 mesh.
    res["straight4"], res["first4"], res["to2x2"] = run_ranks(4, train_then, [
        (_overrides(tmp / "straight4", corpus, cache, mbs=1), None),
        (_overrides(tmp / "half4", corpus, cache, mbs=1), HALF),
        resumed("to2x2", mbs=1, **{"parallel.dp_replicate": 2}),
    ])
    # 2 ranks: the resume on 2 ranks; 12 straight vs 6 + (stop) + resume from the output dir (auto) to 12.
    res["to2"], res["straight2"], res["first2"], res["resumed2"] = run_ranks(2, train_then, [
        resumed("to2", mbs=2),
        (_overrides(tmp / "straight2", corpus, cache, mbs=2), None),
        (_overrides(tmp / "resume2", corpus, cache, mbs=2), HALF),
        (_overrides(tmp / "resume2", corpus, cache, mbs=2), None),
    ])
    (res["to1"],) = run_ranks(1, train_then, [resumed("to1", mbs=4)])
    res["tmp"] = tmp
    return res


def test_exact_resume_is_bitwise(runs):
    straight, resumed = runs["straight2"], runs["resumed2"]
    assert resumed["start"] == HALF + 1  # it really resumed, from step 6
    for step in range(HALF + 1, STEPS + 1):
        assert resumed["loss"][step] == straight["loss"][step], step
    assert resumed["weights"] == straight["weights"]
    assert resumed["optim"] == straight["optim"]


@pytest.mark.parametrize("name", ["to2", "to1", "to2x2"])
def test_reshard_on_resume_continues_the_curve(runs, name):
    straight, resumed = runs["straight4"], runs[name]
    assert resumed["start"] == HALF + 1
    for step in range(HALF + 1, STEPS + 1):
        assert resumed["loss"][step] == pytest.approx(straight["loss"][step], rel=1e-5), (name, step)
    for k, v in straight["weights"].items():
        assert resumed["weights"][k] == pytest.approx(v, rel=1e-4, abs=1e-4), k
    assert resumed["optim"] == pytest.approx(straight["optim"], rel=1e-5)  # moments came along


def test_each_rank_writes_only_its_shard(runs):
    files = runs["first4"]["files"][f"step-{HALF}"]
    assert len(files) == 4
    total = sum(files.values())
    # params + 2 AdamW moments, fp32: 12 bytes/param (+ DCP's per-tensor framing), split over the ranks
    assert 12 * runs["first4"]["numel"] <= total <= 1.15 * 12 * runs["first4"]["numel"]
    for name, size in files.items():
        assert size < 0.3 * total, (name, files)  # a rank holding the full model would write ~100%


def test_keep_last_prunes_but_never_the_newest(runs):
    (ck,) = runs["straight2"]["files"]  # only the final save at interval 0
    assert ck == f"step-{STEPS}"


def checkpoint_safety(tmp: str, corpus: str) -> dict:
    """One rank, one process: partial saves, pruning, bad resume paths, the resume check, the folder
    lock, auto's fallback for each kind of damage, branches, metrics and config files, LR extension."""
    import contextlib
    import io

    from shardlm.config import load_config
    from shardlm.errors import CheckpointError, ConfigError
    from shardlm.train.optim import lr_factor
    from shardlm.train.trainer import Trainer

    tmp = Path(tmp)
    out, log = {}, io.StringIO()

    def base(run="run", **kw):
        return load_config(None, _overrides(tmp / run, corpus, tmp / "cache", mbs=2, **kw))

    def start(cfg, train=False):
        t = Trainer(cfg)
        if train:
            t.train()
        t.checkpointer.close()
        t.release_locks()  # the next Trainer in this process takes the same folder
        return t

    def fails(cfg) -> str | None:
        try:
            start(cfg)
        except (CheckpointError, ConfigError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    with contextlib.redirect_stdout(log):
        start(base(steps=6, **{"checkpoint.interval": 2, "checkpoint.keep_last": 2}), train=True)
        ckdir = tmp / "run" / "checkpoints"
        names = lambda d=ckdir: sorted(p.name for p in d.iterdir() if p.name != "branches")  # noqa: E731
        out["after_prune"] = names()
        # A save that died half way: a .partial directory without metadata.
        (ckdir / ".step-8.partial").mkdir()
        (ckdir / ".step-8.partial" / "__0_0.distcp").write_bytes(b"junk")
        out["resumed_from"] = start(base(steps=6)).resumed_from.name
        out["partial_removed"] = not (ckdir / ".step-8.partial").exists()
        errors = {}
        # Another model shape: a ConfigError before loading, no fallback, nothing moved, config.toml kept.
        config_before = (tmp / "run" / "config.toml").read_text()
        errors["shape"] = fails(base(steps=6, **{"model.n_layers": 2}))
        out["after_mismatch"] = sorted(p.name for p in ckdir.iterdir())
        out["config_kept"] = (tmp / "run" / "config.toml").read_text() == config_before
        # The change allowed on purpose loads (DCP reads the keys the smaller model asks for).
        out["allowed"] = start(base(steps=6, **{"model.n_layers": 2, "checkpoint.allow_changed": "model.n_layers",
                                                "train.output_dir": str(tmp / "allowed"),
                                                "checkpoint.resume": str(ckdir / "step-6")})).resumed_from.name
        # Changed data: a document appended to the raw file after the save. The saved position would mean other
        # samples: one line naming the source's old and new content, unless checkpoint.allow_changed=data.
        grown = tmp / "grown.txt"
        shutil.copy(corpus, grown)
        dc = dict(steps=2, **{"data.path": str(grown), "checkpoint.interval": 2})
        start(base("dc", **dc), train=True)
        with open(grown, "a") as f:
            f.write("\n\nOne more document, appended after the checkpoint was saved.\n")
        errors["data"] = fails(base("dc", **dc))
        out["data_allowed"] = start(base("dc", **dc, **{"checkpoint.allow_changed": "data"})).resumed_from.name
        # One run per folder: a second Trainer while the first holds the folder stops at once.
        live = Trainer(base(steps=6))
        errors["locked"] = fails(base(steps=6))
        live.checkpointer.close()
        live.release_locks()
        out["lock_released"] = not (tmp / "run" / ".shardlm.lock").exists()
        # auto falls back past a newest checkpoint damaged in each way; each one is set aside, not deleted.
        good = ckdir / "step-6"
        damage = {
            "missing_shard": lambda d: [f.unlink() for f in d.glob("*.distcp")],
            "truncated_shard": lambda d: [f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
                                          for f in d.glob("*.distcp")],
            "truncated_metadata": lambda d: (d / ".metadata").write_bytes((d / ".metadata").read_bytes()[:40]),
            "garbage_metadata": lambda d: (d / ".metadata").write_bytes(b"not a checkpoint"),
        }
        out["fallback"], corrupt = {}, None
        for kind, hurt in damage.items():
            shutil.copytree(good, ckdir / "step-7")
            hurt(ckdir / "step-7")
            out["fallback"][kind] = start(base(steps=8)).resumed_from.name
            corrupt = corrupt or next(ckdir.glob("branches/*/step-7"))
        # A half-written last line in metrics.jsonl (a kill) is dropped with a note on resume.
        with open(tmp / "run" / "metrics.jsonl", "a") as f:
            f.write('{"step": 7, "loss": 1.')
        # A model-only final checkpoint on top: training falls back past it (it needs optimizer state).
        start(base(steps=7, **{"checkpoint.model_only": True}), train=True)
        out["metrics_whole"] = all(line.endswith("}") for line in
                                   (tmp / "run" / "metrics.jsonl").read_text().splitlines())
        # ... and a resume that extends train.steps (and halves the global batch) keeps the LR going on.
        t = start(base(steps=8, **{"train.micro_batch_size": 1}))
        out["fallback"]["model_only"] = t.resumed_from.name
        c6 = base(steps=6).train
        out["lr"] = (t.scheduler.get_last_lr()[0], c6.lr * lr_factor(6, c6))
        for name, resume in (("missing", str(tmp / "nope")), ("not_a_checkpoint", str(tmp / "cache")),
                             ("corrupt", str(corrupt))):
            errors[name] = fails(base(**{"checkpoint.resume": resume, "train.output_dir": str(tmp / f"err-{name}")}))
        # Folders that can't be written fail before step 1.
        errors["unwritable"] = fails(base("uw", **{"checkpoint.dir": "/proc/shardlm-ck"}))
        # A model-only final checkpoint with nothing older can't be resumed from.
        start(base(steps=2, **{"checkpoint.model_only": True, "train.output_dir": str(tmp / "mo")}), train=True)
        errors["model_only"] = fails(base(steps=4, **{"train.output_dir": str(tmp / "mo")}))
        # Starting fresh there sets the old checkpoint aside (kept) instead of mixing two lineages.
        start(base(steps=4, **{"train.output_dir": str(tmp / "mo"), "checkpoint.resume": "none"}))
        out["fresh_aside"] = sorted(p.name for p in (tmp / "mo").glob("checkpoints/*/*/step-*"))
        out["errors"] = errors
        # Branching: resume step-4 of a 6-step run and save step-5; step-6 is set aside (not deleted),
        # keep_last=1 never deletes the branch point step-4, and auto then picks step-5, not step-6.
        start(base("br", steps=6, **{"checkpoint.interval": 2, "checkpoint.keep_last": 2}), train=True)
        brck = tmp / "br" / "checkpoints"
        start(base("br", steps=5, **{"checkpoint.resume": str(brck / "step-4"), "checkpoint.keep_last": 1}),
              train=True)
        out["branch"] = {"folder": names(brck), "aside": sorted(p.name for p in brck.glob("branches/*/*")),
                         "auto": start(base("br", steps=5)).resumed_from.name}
    out["log"] = log.getvalue()
    return out


def test_checkpoint_safety(tmp_path, corpus):
    out = run_ranks(1, checkpoint_safety, str(tmp_path), str(corpus))
    log = out["log"]
    assert out["after_prune"] == ["step-4", "step-6"]
    assert out["resumed_from"] == "step-6" and out["partial_removed"]
    e = out["errors"]
    # The resume check: one line naming the field and the fixes, nothing moved, the last config.toml kept.
    assert e["shape"].startswith("ConfigError: ") and "model.n_layers: checkpoint 4, this run 2" in e["shape"]
    assert "checkpoint.resume=none" in e["shape"] and "--checkpoint.allow_changed=model.n_layers" in e["shape"]
    assert out["after_mismatch"] == ["step-4", "step-6"] and out["config_kept"]
    assert out["allowed"] == "step-6" and "model.n_layers changed from 4 to 2 (checkpoint.allow_changed)" in log
    # Changed data: the source, its old and new counts and content hash, and the switch that allows it.
    assert e["data"].startswith("ConfigError: ") and "data: checkpoint '" in e["data"], e["data"]
    assert e["data"].count(str(tmp_path / "grown.txt")) == 2 and "--checkpoint.allow_changed=data" in e["data"]
    old, new = (int(n.replace(",", "")) for n in re.findall(r"(\d[\d,]*) tokens", e["data"]))
    assert new > old and len(set(re.findall(r"sha256 (\w+)", e["data"]))) == 2
    assert out["data_allowed"] == "step-2" and "resuming with data changed from" in log
    # The lock names its holder; released at the end.
    assert "is in use by another run (host " in e["locked"] and f"pid {os.getpid()}" not in e["locked"]
    assert out["lock_released"]
    assert out["fallback"] == dict.fromkeys(("missing_shard", "truncated_shard", "truncated_metadata",
                                             "garbage_metadata", "model_only"), "step-6")
    assert log.count("falling back to step-6") == 5 and "holds the model only" in log
    assert log.count("step-7 (could not be loaded) (not its ancestors) moved to") == 5
    assert "metrics: dropping line" in log and out["metrics_whole"]
    assert "done: ran 1 step (step 7; 7 of train.steps=7)" in log
    assert "the global batch changes from 2 to 1 sequences" in log
    lr, expected = out["lr"]
    assert lr == pytest.approx(expected, rel=1e-9) and "resume: train.steps 7 -> 8" not in log
    assert "does not exist" in e["missing"]
    assert "not a complete checkpoint" in e["not_a_checkpoint"]
    assert "step-7: cannot load (FileNotFoundError" in e["corrupt"]
    assert "checkpoint.dir '/proc/shardlm-ck' cannot be created" in e["unwritable"]
    assert "holds the model only" in e["model_only"]
    assert all(v is not None and "\n" not in v for v in e.values()), e
    assert out["fresh_aside"] == ["step-2"] and "this run starts a new lineage here; step-2" in log
    assert out["branch"] == {"folder": ["step-4", "step-5"], "aside": ["step-6"], "auto": "step-5"}
    assert "resuming step-4 starts a branch; step-6 (not its ancestors) moved to" in log


def async_save_snapshots(tmp: str, corpus: str) -> dict:
    """Async saves with a slow writer: steps run while a save is in flight, and each checkpoint holds
    the state of the step it was taken at."""
    import torch.distributed.checkpoint.filesystem as fs

    from shardlm.config import load_config
    from shardlm.train.trainer import Trainer

    real_write = fs._FileSystemWriter.write_data

    def slow_write(self, plan, planner):
        time.sleep(0.5)  # in the background thread: the training loop must not wait for this
        return real_write(self, plan, planner)

    fs._FileSystemWriter.write_data = slow_write
    snapshots, overlapped = {}, []

    class Probe(Trainer):
        def save(self, final=False, blocking=False):
            snapshots[self.step] = checksums(self.model)
            super().save(final, blocking)

        def train_step(self, batches, stop_requested=False):
            pending = self.checkpointer._pending
            overlapped.append(pending is not None and not pending[0].done())
            return super().train_step(batches, stop_requested)

    tmp = Path(tmp)
    t = Probe(load_config(None, _overrides(tmp / "run", corpus, tmp / "cache", mbs=1, steps=9,
                                           **{"checkpoint.interval": 3, "checkpoint.async": True,
                                              "checkpoint.keep_last": 0})))
    t.train()
    t.checkpointer.close()
    t.release_locks()  # the next Trainer in this process takes the same folder
    fs._FileSystemWriter.write_data = real_write
    loaded = {}
    for step in (3, 6):
        r = Trainer(load_config(None, _overrides(tmp / f"load{step}", corpus, tmp / "cache", mbs=1, steps=9, **{
            "checkpoint.resume": str(tmp / "run" / "checkpoints" / f"step-{step}")})))
        loaded[step] = checksums(r.model)
        r.checkpointer.close()
        r.release_locks()  # the next Trainer in this process takes the same folder
    return {"snapshots": snapshots, "loaded": loaded, "overlapped": sum(overlapped)}


def test_async_save_overlaps_training_and_keeps_the_step_state(tmp_path, corpus):
    out = run_ranks(2, async_save_snapshots, str(tmp_path), str(corpus))
    assert out["overlapped"] >= 2  # training steps ran while a save was in flight
    for step in (3, 6):
        assert out["loaded"][step] == out["snapshots"][step], step  # not a later step's weights
    assert out["snapshots"][3] != out["snapshots"][6]


def init_from_dcp(tmp: str, corpus: str, hf: str, converted: str) -> dict:
    """2 ranks: a run started from `convert hf-to-dcp`'s output equals one started from the HF folder,
    and a model-only final checkpoint is a starting point with the trained weights."""
    from shardlm.config import load_config
    from shardlm.errors import CheckpointError, ConfigError
    from shardlm.train.trainer import Trainer

    tmp = Path(tmp)

    def run(name, init, steps=2, train=True, **kw):
        t = Trainer(load_config(None, _overrides(tmp / name, corpus, tmp / "cache", mbs=1, steps=steps, **{
            "model.init_from": init, "data.tokenizer": f"{hf}/tokenizer.json", **kw})))
        recs = t.train() if train else []
        out = {"loss": [r["loss"] for r in recs], "weights": checksums(t.model)}
        t.checkpointer.close()
        t.release_locks()
        return out

    res = {"hf": run("hf", f"hf:{hf}", **{"checkpoint.model_only": True}), "dcp": run("dcp", f"dcp:{converted}")}
    res["again"] = run("again", f"dcp:{tmp / 'hf' / 'checkpoints' / 'step-2'}", train=False)
    errors = {}
    for name, init, kw in (("missing", f"dcp:{tmp / 'nope'}", {}),
                           ("override", f"dcp:{converted}", {"model.n_layers": 2})):
        try:
            run(f"err-{name}", init, train=False, **kw)
        except (CheckpointError, ConfigError) as e:
            errors[name] = str(e)
    res["errors"] = errors
    return res


def test_init_from_a_dcp_checkpoint(tmp_path, corpus):
    from shardlm.assets.debug_hf import make_tiny_hf
    from shardlm.interop.hf.import_ import import_hf_to_dcp

    hf = make_tiny_hf(tmp_path / "hfmodel")
    import_hf_to_dcp(hf, tmp_path / "converted")
    out = run_ranks(2, init_from_dcp, str(tmp_path), str(corpus), str(hf), str(tmp_path / "converted"))
    assert out["dcp"]["loss"] == out["hf"]["loss"] and len(out["hf"]["loss"]) == 2  # the same start, bit for bit
    assert out["again"]["weights"] == out["hf"]["weights"]  # starts from the trained, model-only weights
    assert "no such folder" in out["errors"]["missing"]
    assert "model.n_layers cannot change the shape" in out["errors"]["override"]
    from shardlm.config import load_config
    from shardlm.resolve import tokenizer_spec

    cfg = load_config(None, [f"--model.init_from=dcp:{tmp_path / 'converted'}"])  # tokenizer auto: the source's
    assert tokenizer_spec(cfg) == str(hf.resolve())
