"""torch.compile per transformer block, before sharding."""

from __future__ import annotations

from torch import nn

from shardlm._torch_compat import compile_backends
from shardlm.errors import ConfigError


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    """torch.compile each block in place, before `fully_shard` (as torchtitan does).

    `Module.compile` keeps parameter names (no `_orig_mod.` prefix: checkpoints, LoRA and HF names
    are unchanged). FSDP2's hooks are not traced (dynamo's `skip_fsdp_hooks`): all-gather and
    reduce-scatter run eagerly around each compiled block. The blocks share one compiled graph
    (parameters are graph inputs), so depth does not multiply compile time.
    """
    if backend not in compile_backends():
        raise ConfigError(f"train.compile_backend={backend!r} is not a torch.compile backend; use one of "
                          f"{', '.join(sorted({*compile_backends(), 'aot_eager', 'eager'}))}")
    for block in model.layers:
        block.compile(backend=backend)
