#!/usr/bin/env python
"""gradfuzz repro: a Partial grad reaching AccumulateGrad transposed turns Replicate.

pytorch/pytorch#180486 (seed 002); fixed in torch 2.13 (PR #180511).
A Replicate DTensor parameter used through to_local(grad_placements=[Partial()])
and then transposed: transpose's backward hands AccumulateGrad a non-contiguous
Partial grad, and its layout fix-up (new_empty_strided + copy_) made .grad
Replicate with an all-reduce. Values stay right; the placement is wrong and a
collective ran that nobody asked for.

Run:  torchrun --nproc-per-node 2 cases/dtensor/partial_grad_transposed_to_replicate.py
      (CPU: gloo; with 2 GPUs: nccl). Exit status 1 on rank 0 when the bug shows.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.utils._python_dispatch import TorchDispatchMode


class CountCollectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into collectives first
        if func.namespace in ("_c10d_functional", "c10d") and not func.__name__.startswith(("wait", "_wrap")):
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def main():
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1))
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = "cuda" if cuda else "cpu"
    rank = dist.get_rank()
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    torch.manual_seed(0)
    w = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 8, 8, device=device), mesh, [Replicate()], run_check=False))
    seen = {}
    counter = CountCollectives()
    w.register_hook(lambda g: seen.update(arrived=g.placements, contiguous=g.is_contiguous(), before=len(counter.ops)))
    w.register_post_accumulate_grad_hook(lambda p: seen.update(after=p.grad.placements, ops=counter.ops[seen["before"]:]))
    x = torch.randn(2, 32, device=device)
    local = w.to_local(grad_placements=[Partial()])
    out = x @ local.transpose(1, 2).reshape(32, 8)
    with counter:
        out.backward(torch.ones_like(out))
    bug = not all(p.is_partial() for p in seen["after"]) or bool(seen["ops"])
    if rank == 0:
        print(f"torch {torch.__version__}: grad arrived {seen['arrived']} (contiguous={seen['contiguous']}), "
              f".grad is {seen['after']}, collectives in AccumulateGrad: {seen['ops'] or 'none'}")
        print("DIVERGES: Partial lost" if bug else "agrees: Partial kept, no collective")
    dist.destroy_process_group()
    return 1 if bug and rank == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
