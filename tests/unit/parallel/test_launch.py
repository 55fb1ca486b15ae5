"""parallel.launch: the one launch path (topology -> dims -> process group -> mesh) of trainer, inference, bench."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from shardlm.config import load_config
from shardlm.distributed.env import shutdown_distributed
from shardlm.errors import ConfigError
from shardlm.parallel.launch import plan_launch

AUTO = ["--parallel.dp_shard=auto", "--parallel.dp_replicate=auto"]


def test_the_plan_resolves_auto_before_any_process_group_with_the_state_for_its_device():
    asked = []

    def state_bytes(device_type: str) -> int:
        asked.append(device_type)
        return 1  # fits any node: auto replicates across nodes

    cfg = load_config(None, ["--train.device=cpu", *AUTO])
    plan = plan_launch(cfg.parallel, "cpu", state_bytes, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    assert (plan.dims.dp_replicate, plan.dims.dp_shard) == (2, 2) and "HSDP 2 x 2" in plan.reason
    assert asked == ["cpu"] and plan.device_type == "cpu" and plan.topology.ranks_per_node == 2
    assert plan.init_timeout_s == cfg.parallel.init_timeout_s and not dist.is_initialized()


def test_a_mesh_that_cannot_fit_fails_in_the_plan():
    cfg = load_config(None, ["--parallel.dp_shard=3", "--parallel.dp_replicate=1"])
    with pytest.raises(ConfigError, match="the world size is 4"):
        plan_launch(cfg.parallel, "cpu", lambda _: 0, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})


def test_one_process_starts_and_builds_its_mesh_with_the_groups_timeout():
    cfg = load_config(None, ["--train.device=cpu"])
    plan = plan_launch(cfg.parallel, "cpu", lambda _: 0, {})
    env = plan.start()
    try:
        mesh = plan.build_mesh(env, timeout_s=123.0)
        assert env.world_size == 1 and mesh.mesh_dim_names == ("dp_shard",) and mesh.size() == 1
    finally:
        shutdown_distributed()
