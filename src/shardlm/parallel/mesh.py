"""ParallelDims: data-parallel degrees -> a named DeviceMesh (1D = FSDP, 2D = HSDP)."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardlm.config import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int  # -1 = fill the rest of the world
    world_size: int

    def __post_init__(self) -> None:
        if self.dp_shard == -1:
            if self.world_size % self.dp_replicate:
                raise ConfigError(
                    f"parallel.dp_replicate={self.dp_replicate} does not divide the world size {self.world_size}; "
                    f"pick a divisor of {self.world_size} or launch a multiple of {self.dp_replicate} ranks")
            object.__setattr__(self, "dp_shard", self.world_size // self.dp_replicate)
        if self.dp_replicate * self.dp_shard != self.world_size:
            raise ConfigError(
                f"mesh parallel.dp_replicate={self.dp_replicate} x parallel.dp_shard={self.dp_shard} = "
                f"{self.dp_replicate * self.dp_shard} ranks, but the world size is {self.world_size}; "
                f"make them multiply to {self.world_size} (or set parallel.dp_shard=-1)")

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches run at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """`("dp_shard",)` for FSDP or `("dp_replicate", "dp_shard")` for HSDP; FSDP2 takes either."""
        if self.hsdp:
            return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard),
                                    mesh_dim_names=("dp_replicate", "dp_shard"))
        return init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))


def dp_rank(mesh: DeviceMesh) -> int:
    """This rank's index among the data-parallel ranks (row-major over the mesh)."""
    return mesh.get_local_rank() if mesh.ndim == 1 else mesh.get_local_rank(0) * mesh.size(1) + mesh.get_local_rank(1)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def launched_world_size() -> int:
    """World size from torchrun's environment (1 when run as a plain process); no collective needed."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def restart_store_warning() -> str | None:
    """torchrun --max-restarts with its shared rendezvous store hands restarted workers the previous
    round's addresses, so the restart fails (pytorch#135712). Say so before it bites."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0):
        return ("shardlm: warning: torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the "
                "launcher's environment, or restarted ranks cannot reconnect (pytorch#135712)")
    return None


def init_distributed(device: str = "auto") -> DistEnv:
    """Join the process group torchrun set up (NCCL on CUDA, gloo on CPU), or make a 1-rank one."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        backend = "cpu:gloo,cuda:nccl"  # NCCL for the model; gloo for host-side counters
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        if launched:
            dist.init_process_group(backend, device_id=dev if use_cuda else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend)


def shutdown_distributed() -> None:
    """Destroy every process group and free its backend now, while the interpreter is fully alive.

    `destroy_process_group()` alone leaves the gloo backend and its worker threads running for as
    long as a DeviceMesh (its `_pg_registry`) or FSDP state still holds the group, which in practice
    is until interpreter shutdown. A worker thread that drops its last tensor then needs the GIL of a
    finalizing interpreter and the process aborts after a successful run ("terminate called without
    an active exception", SIGABRT; pytorch#190489). So: destroy, drop the meshes' references, collect.
    Release the model first (Trainer.close does): its FSDP state holds the groups too.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    for obj in gc.get_objects():
        if type(obj) is DeviceMesh:  # not isinstance: some gc-tracked classes warn in __instancecheck__
            registry = getattr(obj, "_pg_registry", None)  # torch >= 2.9; older meshes hold names only
            if isinstance(registry, dict):
                registry.clear()
    gc.collect()
