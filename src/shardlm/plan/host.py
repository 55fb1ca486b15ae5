"""Host memory (CPU RAM) per node that a plan implies, term by term, from the same fake step.

* load (start-up, transient): an HF import reads each rank's rows of every tensor with safetensors' `get_slice`
  (`shardlm.interop.hf.load`): the file is memory-mapped, and the pages a rank touches (its rows) stay resident
  while the file is open, beside the slice it copies out. Per rank: its share of the largest file plus its
  largest slice. Measured on gloo in tests/distributed/test_host_memory.py.
* CPU offload (train.cpu_offload): FSDP2's CPUOffloadPolicy keeps the sharded parameters, gradients and optimizer
  state in host memory (pinned on GPUs): the fake step's sharded categories, per rank.
* async checkpoints (checkpoint.async): DCP's async_save copies what it saves (the rank's parameter shards as
  stored, or only the trainable ones with lora.adapters_only, and the optimizer state) to host memory before it
  returns, and holds the copy until the write ends. Measured on gloo in tests/distributed/test_host_memory.py.

Not planned: the process itself (python, torch and the CUDA libraries: ~0.3 GiB per rank with the CPU build of
torch here, more with a CUDA build's libraries), the page cache of memory-mapped token stores (shared by a node's
ranks; an SFT store also keeps ~28 B per sample per rank), data workers (none: the loader reads in the rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardlm.config import Config
from shardlm.interop.hf.load import scan_hf_weights
from shardlm.plan.report import Scenario, fmt_bytes

ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


@dataclass
class HostTerms:
    """Bytes of host memory per rank, and the node's total (`ranks_per_node` of them)."""

    ranks_per_node: int
    load: int  # start-up, transient: the HF import
    offload: int  # train.cpu_offload: sharded parameters, gradients, optimizer state
    staging: int  # checkpoint.async: the copy async_save writes from
    load_note: str = ""  # why the load is not planned (an HF folder without its weights here)

    @property
    def training(self) -> int:
        """Per rank while training: offload + staging (they coexist; the load is over by then)."""
        return self.offload + self.staging

    @property
    def per_node(self) -> int:
        """The node's peak: its ranks at start-up (load, into offloaded parameters) or while training."""
        return self.ranks_per_node * max(self.load + self.offload, self.training)

    def lines(self) -> list[str]:
        n = self.ranks_per_node
        out = [f"  host memory per rank ({n} rank{'s' if n != 1 else ''} per node)"]
        for name, value, what in (("HF load", self.load, "start-up: its share of the largest file + a slice"),
                                  ("CPU offload", self.offload, "sharded params, grads, optimizer state"),
                                  ("async save", self.staging, "the copy of what a checkpoint saves")):
            if not value and name == "HF load" and self.load_note:
                what, value = self.load_note, None
            out.append(f"  {'+ ' + name:<16} {fmt_bytes(value):>12}  {what}" if value else
                       f"  {'+ ' + name:<16} {'-':>12}  {what if value is None else ''}".rstrip())
        out.append(f"  {'= per node':<16} {fmt_bytes(self.per_node):>12}  (+ the processes, not planned)")
        return out


def hf_load_bytes(hf_dir: Path | None, shard: int) -> tuple[int, str]:
    """(per-rank host bytes of an HF import, note): the rank's rows of the largest safetensors file (mapped and
    touched) + its largest single slice; 0 when there are no files to read."""
    if hf_dir is None:
        return 0, ""
    try:
        tensors = scan_hf_weights(hf_dir)
    except Exception:  # the planner plans a preset where the folder is absent: nothing to read
        return 0, f"not planned: no safetensors in {hf_dir}"
    per_file: dict[Path, int] = {}
    largest = 0
    for t in tensors.values():
        n = 1
        for d in t.shape:
            n *= d
        rows = -(-t.shape[0] // shard) if t.shape else 1
        mine = n // max(t.shape[0], 1) * rows * ST_BYTES.get(t.dtype, 4) if t.shape else ST_BYTES.get(t.dtype, 4)
        per_file[t.file] = per_file.get(t.file, 0) + mine
        largest = max(largest, mine)
    return max(per_file.values(), default=0) + largest, ""


def host_terms(cfg: Config, scen: Scenario, ranks_per_node: int, shard: int) -> HostTerms:
    """The host memory `cfg` implies per rank and node, from its planned step `scen` (sharded over `shard`)."""
    ms = scen.model_state.raw
    params, grads, optim = ms.get("Sharded Param", 0), ms.get("Sharded Grad", 0), ms.get("OptState", 0)
    offload = params + grads + optim if cfg.train.cpu_offload else 0
    staging = 0
    if cfg.checkpoint.async_ and cfg.checkpoint.interval:
        saved = params
        if cfg.lora.adapters_only and cfg.lora.rank:
            saved = grads  # the trainable shards: fp32, as many bytes as their gradients
        staging = saved + optim
    load, note = hf_load_bytes(cfg.model.hf_dir, shard)
    return HostTerms(ranks_per_node, load, offload, staging, note)
