"""An HF model folder -> a model-only DCP checkpoint our trainer can load (`shardlm convert hf-to-dcp`)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from shardlm.checkpoint.meta import CheckpointMeta
from shardlm.checkpoint.reader import SINGLE_PROCESS_WARNING
from shardlm.errors import ConfigError
from shardlm.fsutil import staged
from shardlm.interop.hf.config import read_hf_config
from shardlm.interop.hf.export import OUT_DTYPES
from shardlm.interop.hf.load import ST_DTYPES, check_hf_tensors, hf_layout, scan_hf_weights
from shardlm.interop.hf.names import expected_shapes, hf_shapes
from shardlm.models.llama import ModelConfig


class _LazyHFPlanner(DefaultSavePlanner):
    """A DCP save planner whose state dict holds meta tensors; each tensor's data is read from its HF file
    (and converted) only when the writer asks for it, then dropped after it is written."""

    def __init__(self, sources: Mapping[str, list[tuple[Path, str, tuple[slice, ...], int | None]]],
                 shapes: Mapping[str, tuple[int, ...]], dtype_of: Mapping[str, torch.dtype]):
        super().__init__()
        self.sources, self.shapes, self.dtype_of = sources, shapes, dtype_of

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        fqn = write_item.index.fqn
        out = torch.empty(self.shapes[fqn], dtype=self.dtype_of[fqn])
        for path, hf_name, region, row in self.sources[fqn]:  # one piece, or one per expert
            with safe_open(str(path), framework="pt") as f:
                (out if row is None else out[row]).copy_(f.get_slice(hf_name)[region])
        return out


@torch.no_grad()
def import_hf_to_dcp(
    hf_dir: str | os.PathLike,
    out_checkpoint_dir: str | os.PathLike,
    *,
    dtype: str | None = "fp32",
    max_seq_len: int | None = None,
) -> ModelConfig:
    """Convert an HF model folder to a model-only DCP checkpoint (`model.*` keys) our trainer can load.

    Offline, one process, no process group (`dcp.save(no_dist=True)`). The state dict DCP plans with
    holds meta tensors; a custom planner reads each tensor from its safetensors file when the writer
    reaches it, so at most about one tensor (plus its `dtype` copy) is in memory at a time — peak
    memory is ~2x the largest tensor (the embedding), whatever the model size. `dtype` None keeps the
    files' dtypes; the default fp32 matches our training parameters. Also writes model_config.json.
    The result is one `__0_0.distcp` file: any number of ranks can load it (DCP reshards on load).
    Returns the ModelConfig.
    """
    src = Path(hf_dir)
    cfg, _ = read_hf_config(src, max_seq_len=max_seq_len)
    stored = scan_hf_weights(src)
    ours = expected_shapes(cfg)
    layout = hf_layout(cfg, src, stored)
    source = check_hf_tensors(stored, hf_shapes(ours, layout), cfg.tie_embeddings, src)
    if dtype is not None and dtype not in OUT_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {', '.join(OUT_DTYPES)} or None")
    sources, shapes, dtype_of, meta_sd = {}, {}, {}, {}
    for name, shape in ours.items():
        pieces = layout[name].region(tuple(slice(0, n) for n in shape))
        first = stored[source[pieces[0][0]]]
        dt = OUT_DTYPES[dtype] if dtype is not None else ST_DTYPES[first.dtype]
        fqn = f"model.{name}"
        sources[fqn] = [(stored[source[h]].file, source[h], region, row) for h, region, row in pieces]
        shapes[fqn], dtype_of[fqn] = tuple(shape), dt
        meta_sd[name] = torch.empty(shape, dtype=dt, device="meta")
    out = Path(out_checkpoint_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not an empty folder; pass a new checkpoint folder")
    # Written beside `out` and swapped in (an empty `out` is replaced); a failure leaves nothing.
    with staged(out, tmp=out.with_name(f".{out.name}.partial"), folder=True) as tmp:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
            dcp.save({"model": meta_sd}, checkpoint_id=str(tmp), planner=_LazyHFPlanner(sources, shapes, dtype_of),
                     no_dist=True)
        # Where it came from: `model.init_from=dcp:<out>` then finds the tokenizer, the export its source.
        src_abs = src.resolve()
        CheckpointMeta(model=cfg, init_from=f"hf:{src_abs}",
                       tokenizer=str(src_abs) if (src_abs / "tokenizer.json").is_file() else None).save(tmp)
    return cfg
