"""Minimal repro for an upstream report (torchao, with torch >= 2.11): `DTensor.full_tensor()` of a DTensor
whose local tensor is torchao's `OptimState8bit` returns codes and scales whose all-gathers were never waited.

    torchrun --standalone --nproc-per-node 2 scripts/upstream/torchao_8bit_full_tensor_unwaited.py

Seen with torch 2.13.0 (CPU, gloo) and torchao 0.18: it prints `inner tensors: AsyncCollectiveTensor,
AsyncCollectiveTensor` and `unwaited collectives: 10` (two per call, five calls), and at exit torch warns
"there are still 10 unwaited collective calls". What happens: OptimState8bit implements
`_c10d_functional.all_gather_into_tensor` and `_wrap_tensor_autograd` by applying them to `codes` and `scale`;
since torch 2.11 `_maybe_wrap_tensor` wraps each result as an AsyncCollectiveTensor (ACT). DTensor's
redistribute then unpads with `aten.slice` and `aten.view`, which OptimState8bit implements by slicing and
viewing its inner tensors; ACT passes view ops through without waiting, so the result holds ACTs that no
one waits for. Reading them (`.codes.clone()`, pickling, `torch.equal`) races with the collective's writer
thread. A plain tensor in the same place is waited (its ACT is waited by the first non-view op or by
redistribute). Workaround (shardlm's tests/helpers/whole.py): after `full_tensor()`, replace each inner
ACT by `act.wait()`.

shardlm never gathers optimizer state whole; only its tests did. Filed here because no session has internet:
whoever can, please report it to pytorch/ao with this script and its output.
"""

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torchao.optim.subclass_8bit import OptimState8bit

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
rows = 512
for i in range(5):
    local = OptimState8bit.zeros((rows, 64), True, 256, torch.device("cpu"), dtype=torch.float32)
    d = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(rows * dist.get_world_size(), 64),
                           stride=(64, 1))
    whole = d.full_tensor()
    if dist.get_rank() == 0 and i == 0:
        print("inner tensors:", type(whole.codes).__name__ + ",", type(whole.scale).__name__)
        print("any ACT:", any(isinstance(t, AsyncCollectiveTensor) for t in (whole.codes, whole.scale)))
if dist.get_rank() == 0:
    print("unwaited collectives:", torch._C._distributed_c10d._get_work_registry_size())
dist.barrier()
dist.destroy_process_group()
