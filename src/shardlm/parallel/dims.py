"""ParallelDims: data-parallel degrees -> a named DeviceMesh (1D = FSDP, 2D = HSDP), and `auto` degrees
chosen from the launch topology.

Node boundaries come from the launcher, never from a guess: torchrun's LOCAL_WORLD_SIZE (its
--nproc-per-node), else SLURM's SLURM_NTASKS_PER_NODE. torchrun numbers ranks node by node
(rank = node * ranks_per_node + local_rank), so a row-major (dp_replicate, dp_shard) mesh with
dp_shard = ranks_per_node keeps every shard group inside one node: FSDP's per-block all-gathers and
reduce-scatters stay on NVLink and only the once-per-step gradient all-reduce crosses nodes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardlm.config import ParallelSection
from shardlm.errors import ConfigError

GIB = 2**30
HSDP_STATE_SHARE = 0.5  # auto replicates when the model state sharded within a node takes at most this share of a device


@dataclass(frozen=True)
class Topology:
    """How the launcher laid the ranks out: `world_size` ranks, `ranks_per_node` of them per node."""

    world_size: int
    ranks_per_node: int
    source: str  # where ranks_per_node came from, for the startup line

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node


def launch_topology(environ: Mapping[str, str] = os.environ) -> Topology:
    """The topology torchrun (LOCAL_WORLD_SIZE) or SLURM (SLURM_NTASKS_PER_NODE) describes; one node for
    a plain process. Anything else is an error for `auto`, not a guess."""
    world = int(environ.get("WORLD_SIZE", "1"))
    if "LOCAL_WORLD_SIZE" in environ:
        per, source = int(environ["LOCAL_WORLD_SIZE"]), "LOCAL_WORLD_SIZE"
    elif "SLURM_NTASKS_PER_NODE" in environ:  # "8", or "8(x2)" for a homogeneous allocation
        m = re.fullmatch(r"(\d+)(\(x\d+\))?", environ["SLURM_NTASKS_PER_NODE"].split(",")[0])
        if m is None:
            raise ConfigError(f"parallel auto: cannot read SLURM_NTASKS_PER_NODE={environ['SLURM_NTASKS_PER_NODE']!r}; "
                              "set parallel.dp_shard and parallel.dp_replicate to numbers")
        per, source = int(m.group(1)), "SLURM_NTASKS_PER_NODE"
    elif world == 1:
        per, source = 1, "one process"
    else:
        raise ConfigError("parallel.dp_shard=auto needs the ranks per node from the launcher (LOCAL_WORLD_SIZE from "
                          "torchrun, or SLURM_NTASKS_PER_NODE); launch with torchrun or set parallel.dp_shard and "
                          "parallel.dp_replicate to numbers")
    if per < 1 or world % per:
        raise ConfigError(f"{source}={per} ranks per node does not divide the world size {world} (nodes with "
                          "different rank counts); launch the same number of ranks on every node, or set "
                          "parallel.dp_shard and parallel.dp_replicate to numbers")
    return Topology(world, per, source)


@dataclass(frozen=True)
class ParallelDims:
    """dp_replicate x dp_shard x cp = world_size. Ranks are laid out row-major over (dp_replicate, dp_shard, cp):
    a CP group is `cp` consecutive ranks (inside a node: its all-to-alls stay on NVLink)."""

    dp_replicate: int
    dp_shard: int  # -1 = fill the rest of the world
    world_size: int
    cp: int = 1  # context-parallel degree (`shardlm.parallel.cp`)

    def __post_init__(self) -> None:
        cp = f" x parallel.cp={self.cp}" if self.cp > 1 else ""
        if self.dp_shard == -1:
            if self.world_size % (self.dp_replicate * self.cp):
                raise ConfigError(
                    f"parallel.dp_replicate={self.dp_replicate}{cp} does not divide the world size "
                    f"{self.world_size}; pick a divisor of {self.world_size} or launch a multiple of "
                    f"{self.dp_replicate * self.cp} ranks")
            object.__setattr__(self, "dp_shard", self.world_size // (self.dp_replicate * self.cp))
        if self.dp_replicate * self.dp_shard * self.cp != self.world_size:
            raise ConfigError(
                f"mesh parallel.dp_replicate={self.dp_replicate} x parallel.dp_shard={self.dp_shard}{cp} = "
                f"{self.dp_replicate * self.dp_shard * self.cp} ranks, but the world size is {self.world_size}; "
                f"make them multiply to {self.world_size} (or set parallel.dp_shard=-1)")

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches run at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def grad_ranks(self) -> int:
        """Ranks whose gradients FSDP averages: every rank (CP ranks hold other tokens of the same rows)."""
        return self.dp * self.cp

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """`("dp_shard",)` for FSDP or `("dp_replicate", "dp_shard")` for HSDP, with a last `"cp"` dimension
        when parallel.cp > 1 (then FSDP takes `fsdp_mesh(mesh)`)."""
        shape = ((self.dp_replicate,) if self.hsdp else ()) + (self.dp_shard,) + ((self.cp,) if self.cp > 1 else ())
        names = (("dp_replicate",) if self.hsdp else ()) + ("dp_shard",) + (("cp",) if self.cp > 1 else ())
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        if self.cp > 1:
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # FSDP's shard dimension (private in torch 2.11-2.13)
        return mesh


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over: `mesh` itself, or with parallel.cp its dp_shard and cp dimensions as one."""
    names = mesh.mesh_dim_names or ()
    if "cp" not in names:
        return mesh
    with warnings.catch_warnings():  # torch 2.11-2.13 warn that slicing a flattened dim "will be deprecated"
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh["dp_replicate", "dp_shard_cp"] if "dp_replicate" in names else mesh["dp_shard_cp"]


def cp_size(mesh: DeviceMesh) -> int:
    return mesh.size(list(mesh.mesh_dim_names).index("cp")) if "cp" in (mesh.mesh_dim_names or ()) else 1


def resolve_dims(p: ParallelSection, topo: Topology, state_bytes: Callable[[], int],
                 device_bytes: int) -> tuple[ParallelDims, str]:
    """ParallelDims for the config's degrees (see `_resolve_dp`); with parallel.cp > 1 the data-parallel degrees
    are resolved over the world_size / cp CP groups, each `cp` consecutive ranks, as if each were one rank
    (the model state shards over dp_shard x cp)."""
    cp = p.cp
    if cp == 1:
        return _resolve_dp(p, topo, state_bytes, device_bytes)
    if topo.world_size % cp:
        raise ConfigError(f"parallel.cp={cp} does not divide the world size {topo.world_size}; pick a divisor of "
                          f"{topo.world_size} or launch a multiple of {cp} ranks")
    if p.dp_replicate != "auto" and p.dp_shard != "auto":
        return ParallelDims(p.dp_replicate, p.dp_shard, topo.world_size, cp), ""
    groups = Topology(topo.world_size // cp, max(1, topo.ranks_per_node // cp), topo.source)
    per_group = dataclasses.replace(p, nvlink_domain=p.nvlink_domain // cp if p.nvlink_domain else 0)
    dims, why = _resolve_dp(per_group, groups, lambda: state_bytes() // cp, device_bytes)
    if why:
        why += f" (each CP group of {cp} consecutive ranks counted as one)"
    return ParallelDims(dims.dp_replicate, dims.dp_shard, topo.world_size, cp), why


def _resolve_dp(p: ParallelSection, topo: Topology, state_bytes: Callable[[], int],
                device_bytes: int) -> tuple[ParallelDims, str]:
    """ParallelDims for the config's degrees, with `auto` resolved, and why (empty when nothing was auto).

    Both auto: shard within a node (or within parallel.nvlink_domain ranks) and replicate across them
    (HSDP) when the model state (`state_bytes()`: fp32 weights + gradients + AdamW moments of what trains,
    the frozen base as stored: lora.base_dtype) sharded over one domain takes at most half of `device_bytes`; else
    shard over every rank (plain FSDP): more ranks to share the state, at the price of all-gathers that
    cross the slow links.
    """
    world, rep, shard = topo.world_size, p.dp_replicate, p.dp_shard
    if rep != "auto" and shard != "auto":
        return ParallelDims(rep, shard, world), ""
    if shard != "auto":  # dp_replicate=auto, dp_shard=N
        if world % shard:
            raise ConfigError(f"parallel.dp_shard={shard} does not divide the world size {world}; pick a divisor "
                              f"of {world} or parallel.dp_shard=auto")
        return ParallelDims(world // shard, shard, world), f"auto: dp_replicate = {world} ranks / dp_shard {shard}"
    if rep != "auto":  # dp_shard=auto, dp_replicate=N
        return ParallelDims(rep, -1, world), f"auto: dp_shard = {world} ranks / dp_replicate {rep}"
    domain = p.nvlink_domain or topo.ranks_per_node
    unit = "NVLink domain" if p.nvlink_domain else "node"
    layout = (f"parallel.nvlink_domain={domain}" if p.nvlink_domain
              else f"{domain} ranks per node, from {topo.source}")
    if world <= domain:
        return ParallelDims(1, world, world), f"auto: FSDP over all {world} ranks (one {unit}: {layout})"
    if world % domain:
        return (ParallelDims(1, world, world),
                f"auto: FSDP over all {world} ranks ({layout} does not divide the world size)")
    per_rank = state_bytes() / domain
    state = f"the model state sharded within a {unit} is {per_rank / GIB:.2f} GiB per rank"
    if per_rank <= HSDP_STATE_SHARE * device_bytes:
        return (ParallelDims(world // domain, domain, world),
                f"auto: HSDP {world // domain} x {domain} ({layout}): {state}, <= half of {device_bytes / GIB:.1f} "
                f"GiB, so the per-block all-gathers stay inside a {unit} and only the gradient all-reduce crosses")
    return (ParallelDims(1, world, world),
            f"auto: FSDP over all {world} ranks ({layout}): {state}, > half of {device_bytes / GIB:.1f} GiB")


def device_memory_bytes(device_type: str, local_rank: int, ranks_per_node: int) -> int:
    """Memory of this rank's device: the GPU's, or on CPU the host's divided among its ranks."""
    if device_type == "cuda":
        import torch

        return torch.cuda.get_device_properties(local_rank).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(ranks_per_node, 1)


def cp_slot(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's index in its CP group, parallel.cp): which contiguous slice of every row it reads."""
    size = cp_size(mesh)
    return (mesh.get_local_rank("cp"), size) if size > 1 else (0, 1)


def dp_rank(mesh: DeviceMesh) -> int:
    """This rank's index among the data-parallel ranks (row-major over the mesh's dp dimensions; the ranks of
    one CP group share it: they read the same rows)."""
    index = 0
    for d, name in enumerate(mesh.mesh_dim_names or ("dp_shard",) * mesh.ndim):
        if name != "cp":
            index = index * mesh.size(d) + mesh.get_local_rank(d)
    return index
