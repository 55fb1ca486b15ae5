"""What a GPU holds beyond the tensors of a step, each a named term with its source.

The tensors (FSDPMemTracker's categories) are measured by the fake step; these are not tensors of the model:

* allocator fragmentation: the caching allocator reserves more than the tensors it holds (`plan.allocator`
  replays the step's allocations through it): reserved - allocated. `torch.cuda.max_memory_reserved()`
  is the tensors' peak + this (+ the cuBLAS workspaces below, which it allocates too).
* cuBLAS workspaces: torch allocates one per (cuBLAS handle, stream) through the caching allocator:
  4096 * 8 * 1024 B = 32 MiB on Hopper and Blackwell (8.125 MiB on Ampere), aten/src/ATen/cuda/
  CublasHandlePool.cpp; training uses two handles (the forward's thread and autograd's backward thread).
  32 MiB each is planned (the larger).
* the CUDA context: driver state and the kernels loaded (lazily, CUDA_MODULE_LOADING=LAZY, torch's default
  since 1.13): 287 MB measured in pytorch/pytorch#86509, ~300-400 MB in NVIDIA's answers on
  pytorch/pytorch#107667 and #109888, 426 MiB with torch 2.10/CUDA 13 (unslothai/unsloth-zoo#1053); more
  kernels load during the first step: 500 MiB is planned. Outside the caching allocator (not in reserved).
* NCCL buffers: per communicator, allocated by NCCL itself (not in reserved) when an algorithm is first
  used: 688 MB measured for a communicator of more than 2 GPUs (NVIDIA/nccl#964, 4 x A100); derived from
  NCCL's source (v2.30, src/transport/p2p.cc, nvls.cc): ~12 MiB per channel and algorithm, plus 256 MiB of
  NVLink-SHARP buffers on 8 x H100/H200 nodes unless NCCL_NVLS_ENABLE=0. FSDP over one mesh dimension uses the
  default process group's communicator (1); HSDP adds one per mesh dimension (3); context parallelism two (the CP
  group, FSDP's flattened dp_shard x cp group). None on one rank.

Not modelled, inside the planner's headroom: kernels' transient workspaces (flash attention's backward keeps
an fp32 dq buffer of B x S x H x D x 4 bytes per attention call: 128 MiB at 1 x 8192 x 32 x 128; cuDNN
attention's workspace), frees that wait on another stream's event, NVLS buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20
CUBLAS_WORKSPACE = 32 * MIB  # per handle, Hopper/Blackwell (CublasHandlePool.cpp)
CUBLAS_HANDLES = 2  # the forward's thread and autograd's backward thread
CUDA_CONTEXT = 500 * MIB
NCCL_PER_COMMUNICATOR = 688 * 10**6  # NVIDIA/nccl#964


def communicators(world_size: int, hsdp: bool, cp: int = 1) -> int:
    """NCCL communicators a run creates: none on one rank, the default group's for FSDP, + one per dimension
    for HSDP; parallel.cp > 1 adds two (the CP group's all-to-alls, FSDP's dp_shard x cp group)."""
    if world_size == 1:
        return 0
    return (3 if hsdp else 1) + (2 if cp > 1 else 0)


def cublas_workspaces() -> list[tuple[int, object, int, str]]:
    """The cuBLAS workspaces as allocations the caching allocator holds from the first matmul on."""
    return [(1, ("cublas", i), CUBLAS_WORKSPACE, "compute") for i in range(CUBLAS_HANDLES)]


@dataclass(frozen=True)
class DeviceTerms:
    """Per GPU, in bytes: the tensors' peak, what the allocator reserves around them, and what sits outside it."""

    tensors: int  # the step's peak of live tensors (FSDPMemTracker): max_memory_allocated, less the workspaces
    reserved: int  # max_memory_reserved: tensors + cuBLAS workspaces + fragmentation (the replayed allocator)
    context: int
    nccl: int
    n_communicators: int

    @property
    def cublas(self) -> int:
        return CUBLAS_HANDLES * CUBLAS_WORKSPACE

    @property
    def fragmentation(self) -> int:
        return max(0, self.reserved - self.tensors - self.cublas)

    @property
    def total(self) -> int:
        """What the device holds at the peak: what nvidia-smi shows, what must fit."""
        return self.reserved + self.context + self.nccl


def device_terms(tensors: int, reserved: int, world_size: int, hsdp: bool, cp: int = 1) -> DeviceTerms:
    n = communicators(world_size, hsdp, cp)
    return DeviceTerms(tensors, max(reserved, tensors), CUDA_CONTEXT, n * NCCL_PER_COMMUNICATOR, n)
