#!/usr/bin/env python
"""gradfuzz repro: a Shard(1) grad of a Shard(0) DTensor parameter becomes a Replicate .grad (torch < 2.13).

(x @ w) * g with w (3, 3) and the gain g (3,) Shard(0) DTensor parameters:
the grad of x @ w is Shard(1) (it carries g's sharding), and a custom
backward hands w's grad to AccumulateGrad transposed (non-contiguous), so it
arrives Shard(1) with strides (1, 3). AccumulateGrad re-lays it out
like the parameter (new_empty_strided + copy_); before 2.13 new_empty_strided
gave a Replicate DTensor, so the copy all-gathers the grad and .grad ends up
Replicate instead of Shard(1). The values are right; the placement and the
collective are not. 2.13 keeps Shard(1).
Run:  torchrun --nproc-per-node 2 THIS_FILE   (gloo on CPU)
Exit status 1 on rank 0 when .grad's placement changed or its values differ.
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


class TransposedGradMatmul(torch.autograd.Function):
    """x @ w whose backward returns w's grad as a transposed view."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        return (w @ gy.mT).mT, (gy.mT @ x).mT  # the values of gy @ w^T and x^T @ gy, strides swapped


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    x, w, g, gy = torch.randn(2, 3), torch.randn(3, 3), torch.randn(3), torch.randn(2, 3)
    w_ref = w.clone().requires_grad_()
    ((x @ w_ref) * g).backward(gy)

    wd = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
    gd = torch.nn.Parameter(distribute_tensor(g, mesh, [Shard(0)]))
    xd = distribute_tensor(x, mesh, [Replicate()])
    (TransposedGradMatmul.apply(xd, wd) * gd).backward(distribute_tensor(gy, mesh, [Replicate()]))
    placement = wd.grad.placements
    same = torch.allclose(wd.grad.full_tensor(), w_ref.grad)
    bad = not same or not placement[0].is_shard(1)
    if dist.get_rank() == 0:
        print(f"torch {torch.__version__}: w.grad is {placement} (values {'agree' if same else 'differ'}), "
              f"expected the Shard(1) the grad arrived with: {'DIVERGES' if bad else 'agrees'}")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
