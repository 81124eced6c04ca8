#!/usr/bin/env python
"""gradfuzz repro: a parameter handed to an FSDP2 unit's forward and not used there gets a zero .grad.

Eager autograd (and DDP) leave .grad None for a parameter that no output depends on, and
optimizers skip it. Under fully_shard, the root's parameter u is passed to a child unit
(inside a dict of activations, as models pass shared tensors to their blocks); the unit does
not use it, yet after backward u.grad is a zero DTensor, so SGD with momentum, weight decay
or Adam go on updating u.
Run:  torchrun --nproc-per-node 2 THIS_FILE   (gloo on CPU)
Exit status 1 on rank 0 when u.grad is not None.
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.v = torch.nn.Parameter(torch.ones(3, 3))

    def forward(self, env):
        return {"h": env["h"] @ env["w"] @ self.v}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3, 3))
        self.u = torch.nn.Parameter(torch.ones(3, 3))  # used by nothing
        self.block = Block()

    def forward(self, x):
        env = {"h": x, "w": self.w, "u": self.u}
        env.update(self.block(env))
        return env["h"]


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Model()
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.ones(2, 3)).sum().backward()
    bad = model.u.grad is not None
    if dist.get_rank() == 0:
        seen = "None" if not bad else f"a DTensor, local piece {model.u.grad.to_local().tolist()}"
        print(f"torch {torch.__version__}: u.grad is {seen}")
        print("DIVERGES" if bad else "agrees")
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
