"""Benchmarks of the fabric a run trains on: `shardlm bench comm` (FSDP's collectives per mesh dimension)."""

from shardlm.bench.comm import (
    COLLECTIVES,
    ModelBytes,
    StepEstimate,
    Traffic,
    bus_factor,
    estimate_step,
    parse_size,
    run_comm_bench,
    step_traffic,
)

__all__ = ["COLLECTIVES", "ModelBytes", "StepEstimate", "Traffic", "bus_factor", "estimate_step", "parse_size",
           "run_comm_bench", "step_traffic"]
