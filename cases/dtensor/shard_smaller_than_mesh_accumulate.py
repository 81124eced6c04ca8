#!/usr/bin/env python
"""gradfuzz repro: accumulating into the .grad of a DTensor sharded on a dim smaller than the mesh raises.

distribute_tensor happily shards a (3, 2) weight with Shard(0) over 4 ranks
(the last rank holds an empty shard), but once .grad exists (gradient
accumulation, a zeroed grad), AccumulateGrad's in-place sum fails:
"aten.add_.Tensor: in-place operations that require placement changes are
not supported ... no valid strategy preserves this placement". 4 and 8 rows
work. Found by gradfuzz's dtensor paths at world size 4 (torch 2.13, gloo).

Run:  torchrun --nproc-per-node 4 cases/dtensor/shard_smaller_than_mesh_accumulate.py
      Exit status 1 on rank 0 when the bug shows.
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def main():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    bad = 0
    for rows in (world - 1, world):
        p = torch.nn.Parameter(distribute_tensor(torch.ones(rows, 2), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.zeros(rows, 2), mesh, [Shard(0)])  # as after an earlier microbatch
        x = distribute_tensor(torch.ones(2, rows), mesh, [Replicate()])
        try:
            (x @ p).sum().backward()
            result = f"ok, .grad {p.grad.placements}"
        except RuntimeError as e:
            result, bad = f"raised: {str(e).splitlines()[0][:160]}", bad + (rows < world)
        if dist.get_rank() == 0:
            print(f"torch {torch.__version__}, {world} ranks, Shard(0) of {rows} rows: {result}")
    rank = dist.get_rank()
    dist.destroy_process_group()
    return 1 if bad and rank == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
