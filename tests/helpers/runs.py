"""Training runs on the current ranks that stop after step k the way SIGTERM does, and what they leave:
losses by step, weight and optimizer checksums, checkpoint files (the distributed checkpoint tests)."""

from __future__ import annotations

from pathlib import Path

from helpers.whole import whole_blocking


def checksums(model) -> dict[str, float]:
    """Each parameter's whole sum (float64): equal sums, equal weights for these comparisons. Gathered with blocking
    c10d collectives (`whole_blocking`: an NF4 weight dequantised per shard), not `full_tensor()` (see
    helpers/whole.py)."""
    return {n: whole_blocking(p).double().sum().item() for n, p in model.named_parameters()}


def optim_checksum(trainer) -> float:
    """The sum of |every optimizer state tensor|, whole (float64; an 8-bit moment dequantised)."""
    total = 0.0
    for state in trainer.optimizer.state.values():
        for v in state.values():
            t = whole_blocking(v)
            total += t.double().abs().sum().item()
    return total


def stop_after_trainer() -> type:
    """A Trainer class whose `stop_after = k` stops a run after step k the way SIGTERM does (request -> save
    -> stop); None: never. (Made on call: workers import the trainer in their own process.)"""
    from shardlm.train.trainer import Trainer

    class StopAfter(Trainer):
        stop_after = None

        def train_step(self, batches, stop_requested=False):
            if self.step + 1 == self.stop_after:
                self.preemption.requested = True
                stop_requested = True
            return super().train_step(batches, stop_requested)

    return StopAfter


def train_then(runs: list[tuple[list[str], int | None]]) -> list[dict]:
    """Train each (config, stop_after) in turn on these ranks; losses by step, weights and optimizer
    checksums. `stop_after=k` stops a run after step k the way SIGTERM does (request -> save -> stop)."""
    from shardlm.config import load_config

    StopAfter = stop_after_trainer()

    out = []
    for overrides, stop_after in runs:
        StopAfter.stop_after = stop_after
        t = StopAfter(load_config(None, overrides))
        recs = t.train()
        files = {}
        for ck in sorted(Path(t.checkpoint_dir).glob("step-*")):
            files[ck.name] = {f.name: f.stat().st_size for f in ck.glob("*.distcp")}
        out.append({"loss": {r["step"]: r["loss"] for r in recs}, "weights": checksums(t.model),
                    "optim": optim_checksum(t), "start": recs[0]["step"] if recs else None, "files": files,
                    "numel": sum(p.numel() for p in t.model.parameters())})
        t.checkpointer.close()
        t.release_locks()  # the next Trainer in this process takes the same folder
    return out
