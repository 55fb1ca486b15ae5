"""Training metrics: progress bar, log lines, metrics.jsonl and TensorBoard (rank 0 only)."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from shardlm.extras import require

# Dense bf16 tensor-core peak per GPU, FLOP/s (vendor datasheets, no sparsity).
PEAK_BF16_FLOPS = {
    "B200": 2.25e15,
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
}

FIELDS = ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "mem_gib", "mem_reserved_gib", "elapsed_s",
          "step_time_max_rank",
          "step_time_spread", "time_data_s", "time_compute_s", "time_optimizer_s", "time_checkpoint_s")
VAL_FIELDS = ("val_loss", "val_ppl", "val_bpb", "val_tokens", "val_time_s")  # on steps that evaluated


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of one GPU, or None (CPU, unknown GPU): then MFU is reported as null."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def read_and_reset_peak_memory(device: torch.device) -> dict[str, float | None]:
    """Peak memory since the last call, in GiB: `mem_gib` = CUDA max allocated and `mem_reserved_gib` = CUDA max
    reserved (what the caching allocator took from the device: `shardlm plan`'s "reserved", the figure torchtitan
    logs), then the CUDA peak counters are reset, so each call measures its own interval; on CPU `mem_gib` is the
    process's peak RSS (since start: never reset) and `mem_reserved_gib` None."""
    if device.type == "cuda":
        peak, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        return {"mem_gib": peak / 2**30, "mem_reserved_gib": reserved / 2**30}
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"mem_gib": kib / 2**20, "mem_reserved_gib": None}


class MetricsLogger:
    """Writes one JSON object per logged step; rank 0 also draws the bar and prints a line."""

    def __init__(self, output_dir: Path, total_steps: int, enabled: bool, progress_bar: bool,
                 tensorboard: bool, start_step: int = 0):
        self.enabled = enabled
        self.bar = self.tb = self.file = None
        if tensorboard:  # checked on every rank, so that all of them stop with the one line
            require("tensorboard", "viz", "metrics.tensorboard=true")
        if not enabled:
            return
        if tensorboard:
            tb = require("torch.utils.tensorboard", "viz", "metrics.tensorboard=true")
            self.tb = tb.SummaryWriter(str(output_dir / "tb"))
        self.file = open(output_dir / "metrics.jsonl", "a")
        if progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(self, record: dict[str, Any]) -> None:
        """A training step's record (with the validation metrics when it evaluated too), or a record of
        validation metrics only (`val_loss`, ..., no `loss`): one metrics.jsonl line, TensorBoard scalars
        (train/<name>, val/<name>), one printed line."""
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not math.isnan(v):
                    self.tb.add_scalar(f"val/{k[4:]}" if k.startswith("val_") else f"train/{k}", v, record["step"])
        parts = [f"step {record['step']:>6}"]
        if "loss" in record:
            parts += [f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}", f"gnorm {record['grad_norm']:.3f}",
                      f"{record['tokens_per_sec']:,.0f} tok/s"]
            if record["mfu"] is not None:  # none on a CPU or a GPU without a known peak (said once at start)
                parts.append(f"mfu {100 * record['mfu']:.1f}%")
            reserved = record.get("mem_reserved_gib")
            parts.append(f"mem {record['mem_gib']:.2f} GiB" + (f" ({reserved:.2f} reserved)" if reserved else ""))
        if "val_loss" in record:
            bpb = f" bpb {record['val_bpb']:.4f}" if record.get("val_bpb") is not None else ""
            parts.append(f"val_loss {record['val_loss']:.4f} ppl {record['val_ppl']:.2f}{bpb} "
                         f"({record['val_tokens']:,} tokens, {record['val_time_s']:.1f}s)")
        self.write(" | ".join(parts))

    def advance(self, loss: float | None = None, val_loss: float | None = None) -> None:
        """One step done; `loss` / `val_loss` (when this step was logged / evaluated) go into the bar's postfix
        (the last val_loss stays there)."""
        if self.bar is not None:
            self.bar.update(1)
            if val_loss is not None:
                self.last_val = val_loss
            if loss is not None or val_loss is not None:
                post = {} if loss is None else {"loss": f"{loss:.4f}"}
                if getattr(self, "last_val", None) is not None:
                    post["val_loss"] = f"{self.last_val:.4f}"
                self.bar.set_postfix(post)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.file is not None:
            self.file.close()


class Throughput:
    """Tokens/s and MFU over the interval since the last `measure`."""

    def __init__(self, flops_per_token: float, peak: float | None, world_size: int):
        self.flops_per_token, self.peak, self.world = flops_per_token, peak, world_size
        self.t0, self.tokens = time.perf_counter(), 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def measure(self) -> tuple[float, float | None]:
        now = time.perf_counter()
        tps = self.tokens / max(now - self.t0, 1e-9)
        self.t0, self.tokens = now, 0
        mfu = None if self.peak is None else tps * self.flops_per_token / (self.peak * self.world)
        return tps, mfu
