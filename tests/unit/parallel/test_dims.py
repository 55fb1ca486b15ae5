"""parallel.dp_shard / dp_replicate = auto: the launch topology from the launcher, the mesh from it."""

from __future__ import annotations

import pytest

from shardlm.build import build_model_config, model_state_bytes
from shardlm.config import load_config
from shardlm.errors import ConfigError
from shardlm.parallel.dims import GIB, Topology, launch_topology, resolve_dims

AUTO = ["--parallel.dp_shard=auto", "--parallel.dp_replicate=auto"]


@pytest.mark.parametrize("environ, expected", [
    ({}, (1, 1, "one process")),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, (16, 8, "LOCAL_WORLD_SIZE")),
    ({"WORLD_SIZE": "16", "SLURM_NTASKS_PER_NODE": "8(x2)"}, (16, 8, "SLURM_NTASKS_PER_NODE")),
    ({"WORLD_SIZE": "8", "SLURM_NTASKS_PER_NODE": "4", "LOCAL_WORLD_SIZE": "2"}, (8, 2, "LOCAL_WORLD_SIZE")),
])
def test_topology_comes_from_the_launcher(environ, expected):
    t = launch_topology(environ)
    assert (t.world_size, t.ranks_per_node, t.source) == expected
    assert t.nodes == expected[0] // expected[1]


@pytest.mark.parametrize("environ, needle", [
    ({"WORLD_SIZE": "4"}, "needs the ranks per node from the launcher"),
    ({"WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "8"}, "does not divide the world size 12"),
    ({"WORLD_SIZE": "8", "SLURM_NTASKS_PER_NODE": "lots"}, "cannot read SLURM_NTASKS_PER_NODE"),
])
def test_topology_is_never_guessed(environ, needle):
    with pytest.raises(ConfigError, match=needle):
        launch_topology(environ)


def _dims(args, topo, state_gib, device_gib=80):
    cfg = load_config(None, args)
    return resolve_dims(cfg.parallel, topo, lambda: int(state_gib * GIB), int(device_gib * GIB))


def test_explicit_degrees_pass_through_and_say_nothing():
    dims, why = _dims(["--parallel.dp_replicate=2"], Topology(8, 4, "x"), 1)
    assert (dims.dp_replicate, dims.dp_shard, why) == (2, 4, "")
    dims, why = _dims(["--parallel.dp_shard=auto", "--parallel.dp_replicate=4"], Topology(8, 8, "x"), 1)
    assert (dims.dp_replicate, dims.dp_shard) == (4, 2) and why.startswith("auto: dp_shard")
    dims, why = _dims(["--parallel.dp_replicate=auto", "--parallel.dp_shard=2"], Topology(8, 8, "x"), 1)
    assert (dims.dp_replicate, dims.dp_shard) == (4, 2) and why.startswith("auto: dp_replicate")
    with pytest.raises(ConfigError, match="parallel.dp_shard=3 does not divide the world size 8"):
        _dims(["--parallel.dp_replicate=auto", "--parallel.dp_shard=3"], Topology(8, 8, "x"), 1)


def test_auto_replicates_across_nodes_when_the_state_fits_a_node():
    dims, why = _dims(AUTO, Topology(16, 8, "LOCAL_WORLD_SIZE"), state_gib=8 * 40)  # 40 GiB/rank = half of 80
    assert (dims.dp_replicate, dims.dp_shard) == (2, 8)
    assert why.startswith("auto: HSDP 2 x 8 (8 ranks per node, from LOCAL_WORLD_SIZE)") and "40.00 GiB" in why
    dims, why = _dims(AUTO, Topology(16, 8, "LOCAL_WORLD_SIZE"), state_gib=8 * 41)
    assert (dims.dp_replicate, dims.dp_shard) == (1, 16)
    assert why.startswith("auto: FSDP over all 16 ranks") and "> half of 80.0 GiB" in why


def test_auto_on_one_node_and_nvlink_domains():
    dims, why = _dims(AUTO, Topology(8, 8, "LOCAL_WORLD_SIZE"), state_gib=1)
    assert (dims.dp_replicate, dims.dp_shard) == (1, 8) and "one node" in why
    # GB200 NVL72: 4 GPUs per node, 72 per NVLink domain; two racks = 144 ranks
    dims, why = _dims([*AUTO, "--parallel.nvlink_domain=72"], Topology(144, 4, "LOCAL_WORLD_SIZE"), state_gib=100)
    assert (dims.dp_replicate, dims.dp_shard) == (2, 72) and "parallel.nvlink_domain=72" in why
    dims, why = _dims([*AUTO, "--parallel.nvlink_domain=72"], Topology(100, 4, "LOCAL_WORLD_SIZE"), state_gib=100)
    assert (dims.dp_replicate, dims.dp_shard) == (1, 100) and "does not divide" in why
    for fixed in (["--parallel.dp_shard=8"], ["--parallel.dp_replicate=2"]):  # no effect there: said so
        with pytest.raises(ConfigError, match=r"parallel.nvlink_domain=72 only shapes the mesh when .* both auto"):
            load_config(None, [*AUTO, "--parallel.nvlink_domain=72", *fixed])


def test_state_bytes_count_what_trains_at_16_and_the_frozen_base_as_stored():
    full = load_config(None, ["--model.preset=llama3_8b"])
    mc = build_model_config(full, 0)
    assert model_state_bytes(full, mc) == 16 * mc.num_params()
    lora = load_config(None, ["--model.preset=llama3_8b", "--lora.rank=16"])
    b = model_state_bytes(lora, mc)  # on a GPU (the default device type) auto stores the base in bf16
    assert 2 * mc.num_params() < b < 2.5 * mc.num_params()  # base at 2 bytes + ~0.5% adapters at 16
    b = model_state_bytes(lora, mc, "cpu")  # auto = fp32 on a CPU
    assert 4 * mc.num_params() < b < 4.5 * mc.num_params()


def test_the_planner_resolves_auto_like_the_trainer():
    from shardlm.plan import resolve_auto

    cfg = load_config(None, ["--model.preset=llama3_70b", "--lora.rank=16", *AUTO])
    mc = build_model_config(cfg, 0)
    resolved, note = resolve_auto(cfg, mc, 16, 8, 80)
    assert (resolved.parallel.dp_replicate, resolved.parallel.dp_shard) == (2, 8)
    assert "HSDP 2 x 8" in note and cfg.parallel.dp_shard == "auto"  # the caller's config is untouched
    resolved, note = resolve_auto(load_config(None, ["--model.preset=llama3_70b", *AUTO]), mc, 16, 8, 80)
    assert (resolved.parallel.dp_replicate, resolved.parallel.dp_shard) == (1, 16)


def test_cp_is_a_third_dimension_of_consecutive_ranks():
    dims, why = _dims(["--parallel.cp=2"], Topology(8, 8, "x"), 1)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.dp, dims.grad_ranks, why) == (1, 4, 2, 4, 8, "")
    dims, _ = _dims(["--parallel.cp=2", "--parallel.dp_replicate=2"], Topology(8, 4, "x"), 1)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp) == (2, 2, 2)
    # auto counts a CP group as one rank: 16 ranks of 8 per node, cp 2 -> 8 groups of 4 per node; the state
    # sharded within a node is still 40 GiB per rank
    dims, why = _dims([*AUTO, "--parallel.cp=2"], Topology(16, 8, "LOCAL_WORLD_SIZE"), state_gib=8 * 40)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp) == (2, 4, 2)
    assert why.startswith("auto: HSDP 2 x 4") and "40.00 GiB" in why and "CP group of 2" in why
    with pytest.raises(ConfigError, match="parallel.cp=3 does not divide the world size 8"):
        _dims(["--parallel.cp=3"], Topology(8, 8, "x"), 1)
    with pytest.raises(ConfigError, match=r"parallel.dp_shard=2 x parallel.cp=2 = 4 ranks, but the world size is 8"):
        _dims(["--parallel.cp=2", "--parallel.dp_shard=2"], Topology(8, 8, "x"), 1)
    with pytest.raises(ConfigError, match="parallel.cp must be >= 1"):
        load_config(None, ["--parallel.cp=0"])


def test_cp_degrees_the_model_and_sequence_take():
    from shardlm.parallel.cp import check_cp
    from shardlm.plan.device import communicators
    from shardlm.plan.search import cp_degrees

    cfg = load_config(None, ["--model.preset=debug", "--data.seq_len=64"])
    assert cp_degrees(cfg, 8, 8, n_heads=4) == [2, 4]  # 8 does not divide 4 heads
    assert cp_degrees(cfg, 8, 8, n_heads=32) == [2, 4, 8] and cp_degrees(cfg, 16, 4, n_heads=32) == [2, 4]
    assert cp_degrees(load_config(None, ["--parallel.cp=2"]), 8, 8, n_heads=32) == []  # already CP
    check_cp(1, 4, 63)  # nothing to split
    with pytest.raises(ConfigError, match="must divide the model's 4 attention heads"):
        check_cp(8, 4, 64)
    with pytest.raises(ConfigError, match="data.seq_len=63; make data.seq_len a multiple of 2"):
        check_cp(2, 4, 63)
    assert (communicators(1, False), communicators(8, False), communicators(8, False, 2),
            communicators(16, True, 2)) == (0, 1, 3, 5)
