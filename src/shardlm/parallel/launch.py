"""THE launch path: topology -> dims -> process group -> mesh, in two steps with room between them.

    plan = plan_launch(cfg.parallel, cfg.train.device, functools.partial(model_state_bytes, cfg, mc))
    env = plan.start()                       # joins (or makes) the process group
    mesh = plan.build_mesh(env)              # or build_mesh(env, timeout_s) to set the mesh groups' timeouts

`plan_launch` reads the launcher's topology and resolves the degrees (`auto` included) before any process
group exists, so a config or launch that cannot work fails on every rank with one line before a collective
waits on it. Whatever must happen before the group starts (the trainer's data preparation) or between the
group and the mesh (its watchdog and signal handlers) goes between the steps. The trainer, inference and
`bench comm` all launch this way, so they agree on the mesh for the same config and launch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from shardlm.config import ParallelSection
from shardlm.distributed.env import DistEnv, device_type, init_distributed
from shardlm.distributed.watchdog import set_timeouts
from shardlm.parallel.dims import ParallelDims, Topology, device_memory_bytes, launch_topology, resolve_dims


@dataclass(frozen=True)
class LaunchPlan:
    """What the config and the launcher imply, before the process group: the layout and the mesh degrees."""

    topology: Topology
    dims: ParallelDims
    reason: str  # why the degrees are what they are, for the startup line ("" when the config gave numbers)
    device_type: str  # train.device resolved: "cuda" | "cpu"
    init_timeout_s: float  # parallel.init_timeout_s: every collective's timeout until it is lowered

    def start(self) -> DistEnv:
        """Join the process group torchrun set up, or make a 1-rank one (`distributed.env.init_distributed`)."""
        return init_distributed(self.device_type, self.init_timeout_s)

    def build_mesh(self, env: DistEnv, timeout_s: float | None = None) -> DeviceMesh:
        """The planned mesh on `env`'s device. `timeout_s`: its groups' collective timeout (they take the
        backend's default, not init_process_group's; `set_timeouts` starts with a barrier)."""
        mesh = self.dims.build_mesh(env.device.type)
        if timeout_s is not None:
            set_timeouts(mesh, timeout_s)
        return mesh


def plan_launch(p: ParallelSection, device: str, state_bytes: Callable[[str], int],
                environ: Mapping[str, str] = os.environ) -> LaunchPlan:
    """The launch of this process, no process group yet. `device`: train.device ("auto" | "cuda" | "cpu");
    `state_bytes(device_type)`: the model state's bytes over all ranks (build.model_state_bytes), called
    only when `auto` degrees need it. ConfigError for a launch or degrees that cannot work."""
    dev = device_type(device)
    topo = launch_topology(environ)
    memory = device_memory_bytes(dev, int(environ.get("LOCAL_RANK", "0")), topo.ranks_per_node)
    dims, reason = resolve_dims(p, topo, lambda: state_bytes(dev), memory)
    return LaunchPlan(topo, dims, reason, dev, p.init_timeout_s)


__all__ = ["LaunchPlan", "plan_launch"]
