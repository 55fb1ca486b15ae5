"""ParallelDims: data-parallel degrees -> a named DeviceMesh (1D = FSDP, 2D = HSDP)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardlm.errors import ConfigError


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
