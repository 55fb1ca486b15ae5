"""The process: join (or make) the process group, and tear it down cleanly."""

from __future__ import annotations

import gc
import itertools
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardlm._torch_compat import release_mesh_groups
from shardlm.distributed.check import start_problems
from shardlm.errors import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def restart_store_warning() -> str | None:
    """torchrun --max-restarts with its shared rendezvous store hands restarted workers the previous
    round's addresses, so the restart fails (pytorch#135712). Say so before it bites."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0):
        return ("shardlm: warning: torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the "
                "launcher's environment, or restarted ranks cannot reconnect (pytorch#135712)")
    return None


def device_type(device: str = "auto") -> str:
    """train.device resolved: "cuda" or "cpu" (before any process group exists)."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    return "cuda" if use_cuda else "cpu"


def init_distributed(device: str = "auto", timeout_s: float | None = None) -> DistEnv:
    """Join the process group torchrun set up (NCCL on CUDA, gloo on CPU), or make a 1-rank one.

    `timeout_s` is every collective's timeout until it is lowered after the first step
    (parallel.init_timeout_s: it must cover compile, data preparation and the checkpoint load).

    A setting that would stop the process group with gloo's or torch's traceback (a GLOO_SOCKET_IFNAME naming
    no interface here, a TORCH_NCCL_ASYNC_ERROR_HANDLING that is no mode: check.start_problems) is a
    ConfigError first. gloo runs on GPUs too (the host-side group here, the async-checkpoint group later): a
    bad GLOO_SOCKET_IFNAME stops a GPU run here, before any checkpoint exists."""
    use_cuda = device_type(device) == "cuda"
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        backend = "cpu:gloo,cuda:nccl"  # NCCL for the model; gloo for host-side counters
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        if problems := start_problems(os.environ, cuda=use_cuda):
            raise ConfigError(str(problems[0]))
        if launched:
            dist.init_process_group(backend, store=_joined_store(timeout), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), device_id=dev if use_cuda else None,
                                    **timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **timeout)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend)


_JOINS = itertools.count()  # process groups this process has joined (every rank joins as often, in the same order)
_STORES: dict[tuple[str, ...], dist.Store] = {}  # the launcher's store, kept for the life of the process


def _joined_store(timeout: dict) -> dist.Store:
    """torchrun's store (env://: MASTER_ADDR/PORT, or torchrun's agent store), under a prefix of its own for each
    time this process joins.

    torch restarts its group names ("0", "1", ...) after destroy_process_group, but the store's keys stay
    (torchrun's agent store outlives the group; env:// shares one TCPStore per port in a process): without a
    prefix per join a second run in one process reads the first run's rendezvous keys for its new groups and
    gloo connects to a closed port or waits on it (with parallel.cp's mesh groups, already in the second
    Trainer). And the store itself is kept for the process: with env:// rank 0 hosts the TCPStore server,
    which would shut down with the first run's group while the other ranks still talk to it."""
    key = tuple(os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                "TORCHELASTIC_RUN_ID"))
    if key not in _STORES:
        _STORES[key] = next(dist.rendezvous("env://", **timeout))[0]
    return dist.PrefixStore(f"shardlm/join{next(_JOINS)}", _STORES[key])


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
            release_mesh_groups(obj)
    gc.collect()
