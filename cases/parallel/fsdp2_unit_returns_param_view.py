#!/usr/bin/env python
"""fsdp2: a unit whose forward returns a view of its own parameter; torch only.

The child unit's forward returns g0.expand(2, 3); FSDP2 frees the unsharded
parameter after that forward (reshard_after_forward) while the view still
points into it, and the root's multiply reads freed memory. Two gloo ranks
on CPU: a rank dies with SIGSEGV (torch 2.11.0, 2.13.0); with NCCL on GPUs:
'CUDA error: an illegal memory access was encountered'. Prints OK and exits
0 when both ranks finish; exit 1 when a rank died.

    python cases/parallel/fsdp2_unit_returns_param_view.py
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Unit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g0 = torch.nn.Parameter(torch.randn(1, 3))

    def forward(self) -> torch.Tensor:
        return self.g0.expand(2, 3)


class Root(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unit = Unit()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.unit()


def rank(r: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=r, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = Root()
    fully_shard(model.unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(2, 3, requires_grad=True)
    out = model(x)
    out.backward(torch.ones_like(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        mp.spawn(rank, args=(os.environ.get("PORT", "29631"),), nprocs=2)
    except mp.ProcessExitedException as e:
        print(f"WRONG: {e}")
        sys.exit(1)
    print("OK: both ranks finished")
