#!/usr/bin/env python
"""gradfuzz repro: an unused DTensor output of a custom autograd.Function gets a plain-tensor grad.

Known upstream: pytorch/pytorch#173123 (open); still reproduces on torch 2.13
with a Python autograd.Function. Autograd materializes the grad of an unused
output as zeros of the output's shape, as a plain torch.Tensor, so a backward
that combines it with the other (DTensor) grad raises "mixed torch.Tensor and
DTensor". gradfuzz's DTensor paths keep such cases outside their contract
(they would fail on every grad-layout handling alike).

Run:  torchrun --nproc-per-node 2 cases/dtensor/function_unused_output_plain_grad.py
      Exit status 1 on rank 0 when the bug shows.
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate


class Two(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a * 2, a * 3

    @staticmethod
    def backward(ctx, g0, g1):
        ctx.kinds = (type(g0).__name__, type(g1).__name__)
        Two.seen = ctx.kinds
        return g0 * 2 + g1 * 3


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    a = DTensor.from_local(torch.ones(2, 2), mesh, [Replicate()], run_check=False).requires_grad_()
    y0, _unused = Two.apply(a)
    try:
        y0.sum().backward()
        error = None
    except RuntimeError as e:
        error = str(e).splitlines()[0]
    rank = dist.get_rank()
    if rank == 0:
        print(f"torch {torch.__version__}: grads into backward: {getattr(Two, 'seen', None)}")
        print(f"DIVERGES: backward raised: {error}" if error else "agrees: backward ran")
    dist.destroy_process_group()
    return 1 if error and rank == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
