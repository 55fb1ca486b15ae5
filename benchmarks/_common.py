"""Helpers shared by the CPU benchmarks in this folder (checkpoint.py, fsdp1_vs_fsdp2.py, lora.py, overhead.py).

The scripts run as `torchrun ... benchmarks/X.py`, so this folder is on sys.path and they `from _common import ...`.

Memory is measured the same way everywhere: `settle()` (gc.collect + malloc_trim(0)) before a baseline, then
`PeakRSS`, a thread that reads /proc/self/statm every 5 ms (resident and anonymous = resident - file-backed/shared
pages), next to the kernel's own peak VmHWM, reset through /proc/self/clear_refs on entry. Collectives assume an
initialised default process group (gloo: CPU tensors).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardlm.data.sources import builtin_files, stdlib_dir

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")

try:
    LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc
    LIBC = None


# -- memory ----------------------------------------------------------------------------------------

def settle() -> None:
    """Free what Python and glibc hold on to, so the baseline RSS is what is live."""
    gc.collect()
    if LIBC is not None and hasattr(LIBC, "malloc_trim"):
        LIBC.malloc_trim(0)


def statm() -> tuple[int, int]:
    """(resident, anonymous = resident - shared/file-backed) bytes of this process."""
    with open("/proc/self/statm") as f:
        v = f.read().split()
    return int(v[1]) * PAGE, (int(v[1]) - int(v[2])) * PAGE


def rss() -> int:
    """Resident bytes of this process (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def reset_hwm() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False where that isn't allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def hwm() -> int:
    """The kernel's peak RSS (VmHWM) of this process, bytes, since start or the last `reset_hwm()`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRSS:
    """Samples this process's RSS every `period` s from a thread while the `with` block runs.

    On exit: `.peak` / `.peak_anon` = the highest resident / anonymous bytes seen (entry and exit included),
    `.added` = peak - `.base`, `.hwm_added` = the kernel's peak (VmHWM, reset on entry) - `.base` (nan where
    the reset isn't allowed). `.base` = the RSS at entry, or the `base` given (e.g. one read before an earlier
    phase); `.base_anon` = the anonymous bytes at entry."""

    def __init__(self, base: int | None = None, period: float = 0.005):
        self.period, self._base = period, base

    def __enter__(self):
        res, anon = statm()
        self.base = res if self._base is None else self._base
        self.base_anon = anon
        self.hwm_ok = reset_hwm()
        self.peak, self.peak_anon = res, anon
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _update(self, res: int, anon: int) -> None:
        if res > self.peak:
            self.peak = res
        if anon > self.peak_anon:
            self.peak_anon = anon

    def _run(self) -> None:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        try:
            while not self._stop.is_set():
                v = os.pread(fd, 128, 0).split()
                self._update(int(v[1]) * PAGE, (int(v[1]) - int(v[2])) * PAGE)
                time.sleep(self.period)
        finally:
            os.close(fd)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._update(*statm())
        self.added = self.peak - self.base
        self.hwm_added = (hwm() - self.base) if self.hwm_ok else float("nan")
        return False


# -- tensor sizes ----------------------------------------------------------------------------------

def local_and_full_bytes(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(this rank's local bytes, full bytes) of tensors (DTensors: local = their shard on this rank)."""
    loc = full = 0
    for t in tensors:
        lt = t.to_local() if isinstance(t, DTensor) else t
        loc += lt.numel() * lt.element_size()
        full += t.numel() * t.element_size()
    return loc, full


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """This rank's bytes of tensors (DTensors: their local shard)."""
    return local_and_full_bytes(tensors)[0]


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The model's parameters + every tensor of the optimizer's state (AdamW: exp_avg, exp_avg_sq, step)."""
    return list(model.parameters()) + [v for s in optimizer.state.values() for v in s.values()
                                       if isinstance(v, torch.Tensor)]


def du(path: Path) -> int:
    """Bytes on disk (apparent size) of a file, or of every file under a directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- collectives -----------------------------------------------------------------------------------

def gather(values: Sequence[float]) -> list[list[float]]:
    """Every rank's `values` (floats, the same count on each rank), indexed [rank][i]."""
    out = [torch.zeros(len(values), dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor(values, dtype=torch.float64))
    return [t.tolist() for t in out]


def slowest(values: Sequence[float]) -> list[float]:
    """Elementwise maximum over ranks of `values` (e.g. wall times: the slowest rank's)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def max_over_ranks(x: float) -> float:
    """The maximum over ranks of one float."""
    return slowest([x])[0]


def say(msg: str) -> None:
    """Print (flushed) on rank 0 only."""
    if dist.get_rank() == 0:
        print(msg, flush=True)


def clear(path: Path) -> None:
    """Delete a file or directory on rank 0, between two barriers (so no rank is still writing or reading it)."""
    dist.barrier()
    if dist.get_rank() == 0:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    dist.barrier()


# -- files -----------------------------------------------------------------------------------------

def write_corpus(path: Path, n_bytes: int, patterns: Sequence[str] = ("*.py",)) -> None:
    """~n_bytes of the running Python's stdlib sources, one .jsonl record (document) per file: the files
    matching each glob pattern (relative to the stdlib dir, e.g. `*/*.py`: one folder down) in turn, each
    pattern's files sorted; from `builtin_files`, so installed packages (site-packages) are left out."""
    root, depths = stdlib_dir(), [len(Path(p).parts) for p in patterns]
    stdlib = builtin_files(max_depth=max(depths) - 1)
    files = [f for p, n in zip(patterns, depths)
             for f in sorted(f for f in stdlib if len(f.relative_to(root).parts) == n and f.relative_to(root).match(p))]
    total = 0
    with open(path, "w") as out:
        for f in files:
            try:
                text = f.read_text("utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            out.write(json.dumps({"text": text}) + "\n")
            total += len(text.encode())
            if total >= n_bytes:
                break


def shared_tmpdir(prefix: str, dir: str | None = None, fill: Callable[[Path], None] | None = None) -> Path:
    """Rank 0 makes a temp dir (`tempfile.mkdtemp(prefix=prefix, dir=dir)`; dir None: $TMPDIR or /tmp) and runs
    `fill(d)` in it (e.g. writes the corpus) while the other ranks wait; every rank gets the path after that.
    If fill raises, rank 0 deletes the dir and re-raises, the other ranks raise too (none is left waiting)."""
    obj: list[str | None] = [None]
    if dist.get_rank() == 0:
        d = Path(tempfile.mkdtemp(prefix=prefix, dir=dir))
        try:
            if fill is not None:
                fill(d)
            obj[0] = str(d)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            dist.broadcast_object_list([None], src=0)
            raise
    dist.broadcast_object_list(obj, src=0)
    if obj[0] is None:
        raise RuntimeError("rank 0 failed to set up the benchmark's temp dir (see its error)")
    return Path(obj[0])


def report(lines: Sequence[str], save_to: Path | None = None) -> None:
    """Print the report (after a blank line); with save_to, also write it there and say so. Call on rank 0."""
    text = "\n".join(lines) + "\n"
    print("\n" + text, end="", flush=True)
    if save_to is not None:
        save_to.parent.mkdir(parents=True, exist_ok=True)
        save_to.write_text(text)
        print(f"saved to {save_to.relative_to(ROOT)}", flush=True)
