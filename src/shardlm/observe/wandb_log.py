"""Weights & Biases logging (metrics.wandb=true; the [wandb] extra): rank 0 logs the metrics.jsonl scalars.

The run's W&B id lives in `<output_dir>/wandb_id`: a run resumed from a checkpoint continues the same W&B
run (`resume="allow"`); a fresh start in the same folder gets a new one (as metrics.jsonl is set aside).
W&B keeps its files under `<output_dir>/wandb/`. `WANDB_MODE=offline` writes them without a network
(`wandb sync <output_dir>/wandb/offline-run-*` uploads them later, the resumed parts into the same run).
"""

from __future__ import annotations

import importlib.util
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardlm.errors import ConfigError
from shardlm.extras import require

WHAT = "metrics.wandb=true"
ID_FILE = "wandb_id"


def run_id(output_dir: Path, resumed: bool) -> str:
    """The W&B run id: the one in <output_dir>/wandb_id when resuming (if any), else a new one, saved there."""
    path = Path(output_dir) / ID_FILE
    if resumed and path.is_file() and (saved := path.read_text().strip()):
        return saved
    new = secrets.token_hex(4)
    path.write_text(new + "\n")
    return new


class WandbLogger:
    """Logs scalars to W&B on the rank where `enabled` (rank 0); elsewhere every method does nothing.

    Every rank checks that wandb is installed (so that all of them stop with the same one line); only the
    enabled one imports it and starts the run.
    """

    def __init__(self, output_dir: Path | str, config: dict[str, Any], project: str, run_name: str | None,
                 enabled: bool, resumed: bool = False, log: Callable[[str], None] | None = None):
        self.run = None
        self.log_line = log or print
        self.repeated: list[int] = []
        if not enabled:
            if importlib.util.find_spec("wandb") is None:
                require("wandb", "wandb", WHAT)  # raises the one line
            return
        wandb = require("wandb", "wandb", WHAT)
        output_dir = Path(output_dir)
        try:
            self.run = wandb.init(project=project or None, name=run_name or None, id=run_id(output_dir, resumed),
                                  resume="allow", dir=str(output_dir), config=config, allow_val_change=True)
        except wandb.errors.Error as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"{WHAT}: W&B could not start the run ({first}); run `wandb login` (or set "
                              "WANDB_API_KEY), or set WANDB_MODE=offline to log locally and `wandb sync` later, "
                              "or metrics.wandb=false") from None

    @property
    def id(self) -> str | None:
        return None if self.run is None else self.run.id

    def log(self, scalars: dict[str, Any], step: int) -> None:
        """`scalars` (a metrics.jsonl record) as train/<name> (val_<name>: val/<name>) at `step`; None values and `step` are left out.

        W&B's steps only increase: a step a resumed run already logged before its restart (the steps
        after the checkpoint) keeps its first values, said once in the log."""
        if self.run is None:
            return
        if step < self.run.step:
            self.repeated.append(step)
            if len(self.repeated) == 1:
                self.log_line(f"wandb: step {step} was logged to W&B run {self.run.id} before the restart "
                              f"(it is at step {self.run.step - 1}); W&B keeps the first values up to there")
            return
        data = {f"val/{k[4:]}" if k.startswith("val_") else f"train/{k}": v for k, v in scalars.items()
                if k != "step" and v is not None}
        self.run.log(data, step=step)

    def finish(self, exit_code: int = 0) -> None:
        """End the run (exit_code != 0 marks it failed in W&B); safe to call twice."""
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=exit_code)


__all__ = ["ID_FILE", "WandbLogger", "run_id"]


def run_wandb(output_dir: Path, cfg: Any, resumed: bool, rank0: bool, on_rank0: Callable, log) -> WandbLogger | None:
    """The run's W&B logger when metrics.wandb is on (rank 0 logs, the others hold a disabled one). Rank 0's
    start may fail (no login): through `on_rank0` every rank stops with its line, none reports a peer gone."""
    m = cfg.metrics
    if not m.wandb:
        return None

    def make(enabled: bool) -> WandbLogger:
        return WandbLogger(output_dir, cfg.to_dict(), m.wandb_project, m.wandb_run_name or None, enabled=enabled,
                           resumed=resumed, log=log)

    made = on_rank0(lambda: make(True))
    return made if rank0 else make(False)
