"""The non-finite guard: checked every step, on every rank, before the optimizer step.

One 2-rank spawn injects a NaN on rank 1 only (into its loss, or into one of its local gradients)
and checks that both ranks agree, that `skip` leaves weights, AdamW state and the schedule exactly
as before the step, that `skip` stops after train.max_skipped_steps in a row, and that `stop` fails
with one line naming the step, the rank and what went bad, keeps the last checkpoint, and resumes
from it exactly like a run that never saw the NaN.
"""

from __future__ import annotations

import pytest
from helpers.launch import run_ranks
from helpers.whole import local, whole

STEPS = 8


def _overrides(tmp, corpus, tag, **extra):
    o = {"model.preset": "debug", "train.steps": STEPS, "train.output_dir": f"{tmp}/{tag}",
         "train.mixed_precision": "fp32", "train.micro_batch_size": 2, "train.grad_accum": 2,
         "train.lr": 3e-3, "train.warmup_steps": 2, "data.path": str(corpus), "data.seq_len": 64,
         "data.cache_dir": f"{tmp}/cache", "metrics.log_every": 1, "metrics.progress_bar": False,
         "checkpoint.save_final": False}
    o.update(extra)
    return [f"--{k}={v}" for k, v in o.items()]


def _inject(module, at_calls: set[int], where: str):
    """Wrap the trainer's forward_backward: on rank 1, at the given calls (1-based), poison the loss or a grad."""
    import torch.distributed as dist

    real = module.forward_backward
    calls = {"n": 0}

    def poisoned(model, *args, **kwargs):
        loss_sum = real(model, *args, **kwargs)
        calls["n"] += 1
        if dist.get_rank() == 1 and calls["n"] in at_calls:
            if where == "loss":
                return loss_sum * float("nan")
            p = next(p for p in model.parameters() if p.grad is not None)
            local(p.grad).view(-1)[0] = float("inf")
        return loss_sum

    module.forward_backward = poisoned
    return lambda: setattr(module, "forward_backward", real)


def _snapshot(trainer) -> dict:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)

    def full(v):
        return whole(v).clone() if torch.is_tensor(v) else v

    flat = {f"model.{k}": full(v) for k, v in model_sd.items()}
    for name, st in optim_sd["state"].items():
        flat.update({f"optim.{name}.{k}": full(v) for k, v in st.items()})
    flat["lr"] = trainer.scheduler.get_last_lr()[0]
    flat["sched_epoch"] = trainer.scheduler.last_epoch
    return flat


def _worker(tmp, corpus) -> dict:
    import torch
    import torch.distributed as dist

    import shardlm.train.trainer as T
    from shardlm.config import load_config
    from shardlm.errors import TrainingError

    out = {}
    # 1. skip: a NaN loss on rank 1 only (gradients stay finite: only the flag on the norm's all-reduce
    #    can tell rank 0), then a non-finite gradient on rank 1 only.
    for where in ("loss", "grad"):
        t = T.Trainer(load_config(None, _overrides(tmp, corpus, f"skip_{where}", **{"train.nonfinite": "skip"})))
        for _ in range(2):
            assert t.train_step(t.loader.next_step()).nonfinite is None
        before = _snapshot(t)
        undo = _inject(T, {1}, where)
        res = t.train_step(t.loader.next_step())
        undo()
        after = _snapshot(t)
        same = all(torch.equal(before[k], after[k]) if torch.is_tensor(before[k]) else before[k] == after[k]
                   for k in before)
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, res.nonfinite)
        nxt = t.train_step(t.loader.next_step())  # the next step trains again
        out[f"skip_{where}"] = {"flags": flags, "unchanged": same, "next_ok": nxt.nonfinite is None,
                                "n_keys": len(before)}
        t.checkpointer.close()
        t.release_locks()  # the next Trainer in this process takes the same folder
        del t
    # 2. skip stops after max_skipped_steps in a row
    t = T.Trainer(load_config(None, _overrides(tmp, corpus, "skip_many", **{"train.nonfinite": "skip",
                                                                            "train.max_skipped_steps": 3})))
    undo = _inject(T, set(range(3, 100)), "loss")
    try:
        t.train()
        out["too_many"] = None
    except TrainingError as e:
        out["too_many"] = (str(e), t.step, t.skipped_total)
    undo()
    t.checkpointer.close()
    t.release_locks()  # the next Trainer in this process takes the same folder
    del t
    # 3. stop: one line, the last checkpoint stands, resume == a run that never saw the NaN
    ref = T.Trainer(load_config(None, _overrides(tmp, corpus, "ref")))
    ref_losses = [r["loss"] for r in ref.train()]
    ref.checkpointer.close()
    ref.release_locks()  # the next Trainer in this process takes the same folder
    del ref
    cfg = _overrides(tmp, corpus, "stop", **{"checkpoint.interval": 2})
    t = T.Trainer(load_config(None, cfg))
    undo = _inject(T, {5}, "loss")
    try:
        t.train()
        out["stop"] = None
    except TrainingError as e:
        out["stop"] = str(e)
    undo()
    t.checkpointer.close()
    t.release_locks()  # the next Trainer in this process takes the same folder
    del t
    from shardlm.checkpoint import complete_checkpoints
    from pathlib import Path

    out["ckpts"] = [p.name for p in complete_checkpoints(Path(f"{tmp}/stop/checkpoints"))]
    t = T.Trainer(load_config(None, cfg))
    resumed_at = t.step
    out["resume"] = (resumed_at, [r["loss"] for r in t.train()], ref_losses)
    t.checkpointer.close()
    t.release_locks()  # the next Trainer in this process takes the same folder
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory, corpus):
    return run_ranks(2, _worker, str(tmp_path_factory.mktemp("nonfinite")), str(corpus))


@pytest.mark.parametrize("where, needle", [("loss", "loss is not finite on rank 1"),
                                           ("grad", "gradients are not finite on rank")])
def test_skip_leaves_every_state_unchanged_and_all_ranks_agree(results, where, needle):
    r = results[f"skip_{where}"]
    assert r["flags"][0] == r["flags"][1] and needle in r["flags"][0], r["flags"]
    assert r["unchanged"] and r["n_keys"] > 20  # weights, AdamW moments and steps, lr, scheduler position
    assert r["next_ok"]


def test_skip_stops_after_max_skipped_steps_in_a_row(results):
    msg, step, skipped = results["too_many"]
    assert "3 non-finite steps in a row" in msg and "train.max_skipped_steps=3" in msg
    assert step == 2 and skipped == 3  # two good updates, then three skipped


def test_stop_names_step_rank_and_what_and_resumes_from_the_last_good_checkpoint(results):
    msg = results["stop"]
    assert msg is not None and "\n" not in msg
    assert "optimizer step 5" in msg and "loss is not finite on rank 1" in msg and "train.nonfinite=skip" in msg
    assert results["ckpts"] == ["step-2", "step-4"]  # nothing saved after the bad step
    resumed_at, losses, ref = results["resume"]
    assert resumed_at == 4 and losses == ref[4:]  # bitwise: as if the NaN never happened
