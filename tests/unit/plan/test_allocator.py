"""The replayed CUDA caching allocator (shardlm.plan.allocator) follows the rules of torch's expandable segments:
best fit, splits, merges, growth by pages at the end (joined to a free last block), one segment per stream and
pool; and the planner's replay of a fake step allocates what the tracker saw (plus the cuBLAS workspaces).

What no CPU test can check: the replay against a real CUDA allocator. No GPU has been lent to this project;
benchmarks/gpu_memory.py is the prepared check (planned reserved vs torch.cuda.max_memory_reserved)."""

from __future__ import annotations

import dataclasses
import importlib

from shardlm.plan.allocator import LARGE_PAGE, SMALL_PAGE, CachingAllocator, replay, round_size

MIB = 2**20


def test_round_size():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024 and round_size(0) == 512


def test_best_fit_takes_the_smallest_free_block_that_holds_the_request():
    a = CachingAllocator()
    for key, mib in (("a", 30), ("x", 4), ("b", 50), ("y", 4)):
        a.alloc(key, mib * MIB)
    a.free("a")
    a.free("b")
    reserved = a.reserved
    a.alloc("c", 25 * MIB)  # fits in a's 30 MiB hole and in b's 50: the smaller one
    seg, block, _ = a._live["c"]
    assert block.start == 0 and a.reserved == reserved
    a.alloc("d", 45 * MIB)  # only b's hole holds it
    assert a._live["d"][1].start == 34 * MIB and a.reserved == reserved


def test_freed_neighbours_merge_and_the_segment_grows_from_a_free_last_block():
    a = CachingAllocator()
    a.alloc("a", 10 * MIB)
    a.alloc("b", 10 * MIB)
    assert a.reserved == LARGE_PAGE  # 20 MiB: one page holds both
    a.free("a")
    a.free("b")  # merged: one free 20 MiB block
    a.alloc("c", 20 * MIB)
    assert a.reserved == LARGE_PAGE and a._live["c"][1].start == 0
    a.free("c")
    a.alloc("d", 30 * MIB)  # the free last block (20 MiB) + one more page, not two new pages
    assert a.reserved == 2 * LARGE_PAGE and a._live["d"][1].start == 0


def test_a_stream_does_not_use_another_streams_free_blocks():
    a = CachingAllocator()
    a.alloc("a", 100 * MIB, "all-gather")
    a.free("a")
    a.alloc("b", 100 * MIB)  # compute stream: its own segment
    assert a.reserved == 2 * 100 * MIB and a.allocated == 100 * MIB


def test_small_requests_use_the_small_pool_with_2_mib_pages():
    a = CachingAllocator()
    a.alloc("s", 1000)
    assert a.reserved == SMALL_PAGE and a.allocated == round_size(1000)
    a.alloc("l", 2 * MIB)
    assert a.reserved == SMALL_PAGE + LARGE_PAGE


def test_fragmentation_a_request_larger_than_any_hole_grows_the_segment():
    a = CachingAllocator()
    for i in range(4):
        a.alloc(i, 20 * MIB)
        a.alloc(("pin", i), 20 * MIB)  # stays: the holes never merge
    for i in range(4):
        a.free(i)
    assert a.allocated == 80 * MIB and a.reserved == 160 * MIB
    a.alloc("big", 40 * MIB)  # 80 MiB free, no hole of 40
    assert a.reserved == 200 * MIB and a.peak_reserved == 200 * MIB


def test_replay_of_a_repeated_step_reaches_its_steady_state():
    before = [(1, "params", 100 * MIB, "compute")]
    step = [(1, "act1", 30 * MIB, "compute"), (1, "act2", 50 * MIB, "compute"), (-1, "act1", 0, "compute"),
            (1, "grad", 20 * MIB, "reduce-scatter"), (-1, "act2", 0, "compute"), (-1, "grad", 0, "reduce-scatter")]
    one, three = replay(before, step, steps=1), replay(before, step, steps=3)
    assert one.peak_allocated == three.peak_allocated == 100 * MIB + 80 * MIB + 0  # grad comes after act1 is freed
    assert three.peak_reserved == one.peak_reserved  # the second step finds the first one's blocks
    assert one.peak_reserved == 180 * MIB + LARGE_PAGE  # compute 180 MiB (9 pages) + the reduce-scatter stream's page


def test_planner_replay_allocates_what_the_tracker_saw():
    """The fake step's replay holds at its peak exactly the tracker's peak + the cuBLAS workspaces (allocated), and
    reserves more (pages, holes, other streams); the plan reports both."""
    from shardlm.config import load_config
    from shardlm.plan import allocator, plan
    from shardlm.plan.device import CUBLAS_HANDLES, CUBLAS_WORKSPACE

    fs = importlib.import_module("shardlm.plan.fake_step")  # the module (the package exports its function)

    seen = []

    def spy(before, step, steps=2):
        a = real(before, step, steps)
        seen.append(a)
        return a

    real, fs.replay = allocator.replay, spy
    try:
        cfg = load_config(None, ["--model.preset=debug", "--model.dim=256", "--model.ffn_dim=768", "--data.seq_len=128",
                                 "--train.micro_batch_size=4", "--parallel.reshard_after_forward=true"])
        r = plan(cfg, world_size=2, gpu_mem_gib=80, alternatives=False, exact=True)
    finally:
        fs.replay = real
    full = seen[0]  # the first replay: everything on the GPU (the second leaves out what CPU offload moves)
    b = r.base
    tensors = b.peak.total + CUBLAS_HANDLES * CUBLAS_WORKSPACE
    # the same moment: equal but for the allocator's 512-byte rounding (the tracker counts CPU bytes exactly)
    assert tensors <= full.peak_allocated <= tensors * 1.001, (full.peak_allocated, tensors)
    assert b.device.reserved == full.peak_reserved > full.peak_allocated
    assert b.device.fragmentation == b.device.reserved - b.peak.total - CUBLAS_HANDLES * CUBLAS_WORKSPACE
    assert b.peak_bytes == b.device.total == b.device.reserved + b.device.context + b.device.nccl
    assert dataclasses.asdict(b.device)["tensors"] == b.peak.total
