"""`model.init_from = "dcp:/path"`: start a run from the model weights of a DCP checkpoint.

The checkpoint is one that `shardlm convert hf-to-dcp` wrote, or a shardlm checkpoint (a model-only
final one, or any full one: only its `model.*` tensors are read). The shape comes from its
`model_config.json`; each rank reads only its own shards (DCP reshards on load, whatever the number
of ranks that wrote it), so no rank holds the whole model. It is a starting point, not a resume: the
optimizer, step, schedule and data position start fresh, and the run's own checkpoints (resume=auto)
take precedence once there are any. LoRA adapters are initialised as usual (B = 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from shardlm.checkpoint.manager import SafeLoadPlanner, read_keys
from shardlm.checkpoint.meta import CheckpointMeta
from shardlm.checkpoint.stored import StoredForm
from shardlm.errors import CheckpointError
from shardlm.lora import is_lora_param
from shardlm.models.llama import ModelConfig

DCP_PREFIX = "dcp:"
_MODEL = "model."


def dcp_model_config(path: Path) -> ModelConfig:
    """The shape recorded in a DCP checkpoint; CheckpointError when it is not a complete checkpoint with one."""
    if not path.exists():
        raise CheckpointError(f"model.init_from=dcp:{path}: no such folder; pass a step-N checkpoint or the output "
                              "of `shardlm convert hf-to-dcp`")
    read_keys(path)
    return CheckpointMeta.load(path).require_model(path)


def load_dcp_weights(model: nn.Module, path: Path, *, forms: Sequence[StoredForm]) -> None:
    """Fill the (sharded) model's non-LoRA weights from `path`'s `model.*` tensors, in place. A parameter held
    in one of `forms` (a QLoRA base) is read as its plain weight into `plain_like` buffers of this
    rank's shards, then filled by its form."""
    stored = {k[len(_MODEL):] for k in read_keys(path) if k.startswith(_MODEL)}
    state = get_model_state_dict(model)
    adapters = sorted(k for k in stored if is_lora_param(k))
    if adapters:
        raise CheckpointError(f"model.init_from=dcp:{path} holds LoRA adapters ({adapters[0]}, ...), which a starting "
                              "point would drop: resume it with checkpoint.resume, or export it merged "
                              "(`shardlm convert dcp-to-hf --merge-lora`) and start from model.init_from=hf:<that>")
    wanted = {k: v for k, v in state.items() if not is_lora_param(k)}
    missing = sorted(wanted.keys() - stored)
    if missing:
        raise CheckpointError(f"model.init_from=dcp:{path} lacks {len(missing)} weight(s) this model needs "
                              f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); pass a checkpoint "
                              "of the same model")
    plain = [(form, {n: form.plain_like(model, n) for n in sorted(form.names(model))})
             for form in forms]
    buffers = {n: b for _, bufs in plain for n, b in bufs.items()}
    rest = {k: v for k, v in wanted.items() if k not in buffers}
    dcp.load({"model": {**rest, **buffers}}, checkpoint_id=str(path), planner=SafeLoadPlanner())
    set_model_state_dict(model, rest, options=StateDictOptions(strict=False))
    for form, bufs in plain:
        if bufs:
            form.fill(model, bufs)
