"""DCP checkpoints on real gloo groups: exact resume, resharding N -> M ranks, async saves, safety."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from launch import run_ranks

STEPS, HALF = 12, 6


def _overrides(out, corpus, cache, mbs, steps=STEPS, **extra):
    o = {"model.preset": "debug", "train.steps": steps, "train.output_dir": str(out),
         "train.mixed_precision": "fp32", "train.micro_batch_size": mbs, "train.lr": 3e-3, "train.warmup_steps": 3,
         "data.path": str(corpus), "data.seq_len": 64, "data.cache_dir": str(cache), "metrics.log_every": 1,
         "metrics.progress_bar": False}
    o.update(extra)
    return [f"--{k}={v}" for k, v in o.items()]


def _checksums(model) -> dict[str, float]:
    return {n: p.full_tensor().double().sum().item() for n, p in model.named_parameters()}


def _optim_checksum(trainer) -> float:
    total = 0.0
    for state in trainer.optimizer.state.values():
        for v in state.values():
            t = v.full_tensor() if hasattr(v, "full_tensor") else v
            total += t.double().abs().sum().item()
    return total


def train_then(runs: list[tuple[list[str], int | None]]) -> list[dict]:
    """Train each (config, stop_after) in turn on these ranks; losses by step, weights and optimizer
    checksums. `stop_after=k` stops a run after step k the way SIGTERM does (request -> save -> stop)."""
    from shardlm.config import load_config
    from shardlm.train.trainer import Trainer

    class StopAfter(Trainer):
        stop_after = None

        def train_step(self, batches, stop_requested=False):
            if self.step + 1 == self.stop_after:
                self.preemption.requested = True
                stop_requested = True
            return super().train_step(batches, stop_requested)

    out = []
    for overrides, stop_after in runs:
        StopAfter.stop_after = stop_after
        t = StopAfter(load_config(None, overrides))
        recs = t.train()
        files = {}
        for ck in sorted(Path(t.checkpoint_dir).glob("step-*")):
            files[ck.name] = {f.name: f.stat().st_size for f in ck.glob("*.distcp")}
        out.append({"loss": {r["step"]: r["loss"] for r in recs}, "weights": _checksums(t.model),
                    "optim": _optim_checksum(t), "start": recs[0]["step"] if recs else None, "files": files,
                    "numel": sum(p.numel() for p in t.model.parameters())})
        t.checkpointer.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("ckpt")
    cache = tmp / "cache"
    res = {}
    # 4 ranks: one straight 12-step run, and a 6-step run that saves its final state.
    res["straight4"], res["first4"] = run_ranks(4, train_then, [
        (_overrides(tmp / "straight4", corpus, cache, mbs=1), None),
        (_overrides(tmp / "half4", corpus, cache, mbs=1), HALF),
    ])
    ck = tmp / "half4" / "checkpoints" / f"step-{HALF}"
    for name, world, mbs, extra in (("to2", 2, 2, {}), ("to1", 1, 4, {}),
                                    ("to2x2", 4, 1, {"parallel.dp_replicate": 2})):
        (res[name],) = run_ranks(world, train_then, [
            (_overrides(tmp / name, corpus, cache, mbs=mbs, **{"checkpoint.resume": str(ck), **extra}), None)])
    # 2 ranks: 12 straight vs 6 + (stop) + resume from the output dir (auto) to 12.
    res["straight2"], res["first2"], res["resumed2"] = run_ranks(2, train_then, [
        (_overrides(tmp / "straight2", corpus, cache, mbs=2), None),
        (_overrides(tmp / "resume2", corpus, cache, mbs=2), HALF),
        (_overrides(tmp / "resume2", corpus, cache, mbs=2), None),
    ])
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
    """One rank: partial saves are ignored and removed, pruning, bad resume paths, auto fallback."""
    from shardlm.config import load_config
    from shardlm.errors import CheckpointError
    from shardlm.train.trainer import Trainer

    tmp = Path(tmp)
    out = {}
    base = lambda **kw: load_config(None, _overrides(tmp / "run", corpus, tmp / "cache", mbs=2, **kw))  # noqa: E731
    t = Trainer(base(steps=6, **{"checkpoint.interval": 2, "checkpoint.keep_last": 2}))
    t.train()
    t.checkpointer.close()
    ckdir = tmp / "run" / "checkpoints"
    out["after_prune"] = sorted(p.name for p in ckdir.iterdir())
    # A save that died half way: a .partial directory without metadata.
    (ckdir / ".step-8.partial").mkdir()
    (ckdir / ".step-8.partial" / "__0_0.distcp").write_bytes(b"junk")
    t = Trainer(base(steps=6))
    out["resumed_from"] = t.resumed_from.name
    out["partial_removed"] = not (ckdir / ".step-8.partial").exists()
    t.checkpointer.close()
    # The newest complete one is corrupt (a shard file lost): auto falls back to the previous one.
    shutil.copytree(ckdir / "step-6", ckdir / "step-7")
    for f in (ckdir / "step-7").glob("*.distcp"):
        f.unlink()
    t = Trainer(base(steps=8))
    out["fallback_from"] = t.resumed_from.name
    t.checkpointer.close()
    errors = {}
    for name, resume in (("missing", str(tmp / "nope")), ("not_a_checkpoint", str(tmp / "cache")),
                         ("corrupt", str(ckdir / "step-7"))):
        try:
            Trainer(base(**{"checkpoint.resume": resume, "train.output_dir": str(tmp / f"err-{name}")}))
            errors[name] = None
        except CheckpointError as e:
            errors[name] = str(e)
    # A model-only final checkpoint can't be resumed from.
    t = Trainer(base(steps=2, **{"checkpoint.model_only": True, "train.output_dir": str(tmp / "mo")}))
    t.train()
    t.checkpointer.close()
    try:
        Trainer(base(steps=4, **{"train.output_dir": str(tmp / "mo")}))
        errors["model_only"] = None
    except CheckpointError as e:
        errors["model_only"] = str(e)
    out["errors"] = errors
    return out


def test_checkpoint_safety(tmp_path, corpus):
    out = run_ranks(1, checkpoint_safety, str(tmp_path), str(corpus))
    assert out["after_prune"] == ["step-4", "step-6"]
    assert out["resumed_from"] == "step-6" and out["partial_removed"]
    assert out["fallback_from"] == "step-6"
    e = out["errors"]
    assert "does not exist" in e["missing"]
    assert "not a complete checkpoint" in e["not_a_checkpoint"]
    assert "step-7: cannot load (FileNotFoundError" in e["corrupt"]
    assert "holds the model only" in e["model_only"]
    assert all("\n" not in v for v in e.values())


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
            snapshots[self.step] = _checksums(self.model)
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
    fs._FileSystemWriter.write_data = real_write
    loaded = {}
    for step in (3, 6):
        r = Trainer(load_config(None, _overrides(tmp / f"load{step}", corpus, tmp / "cache", mbs=1, steps=9, **{
            "checkpoint.resume": str(tmp / "run" / "checkpoints" / f"step-{step}")})))
        loaded[step] = _checksums(r.model)
        r.checkpointer.close()
    return {"snapshots": snapshots, "loaded": loaded, "overlapped": sum(overlapped)}


def test_async_save_overlaps_training_and_keeps_the_step_state(tmp_path, corpus):
    out = run_ranks(2, async_save_snapshots, str(tmp_path), str(corpus))
    assert out["overlapped"] >= 2  # training steps ran while a save was in flight
    for step in (3, 6):
        assert out["loaded"][step] == out["snapshots"][step], step  # not a later step's weights
    assert out["snapshots"][3] != out["snapshots"][6]
