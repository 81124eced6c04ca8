#!/usr/bin/env python
"""gradfuzz repro: clip_grad_norm_ leaves a Partial DTensor grad unclipped (torch < 2.12).

clip_grad_norm_ scales the grads with torch._foreach_mul_. DTensor's 2.11
strategy for the foreach pointwise ops treats it as non-linear, so a
Partial(sum) grad is all-reduced into a temporary that is scaled and dropped;
the grad itself is untouched and no error is raised. The returned total norm
is right. foreach=False (per-tensor mul_) clips correctly.

Run:  torchrun --nproc-per-node 2 cases/dtensor/clip_foreach_partial_grad_unscaled.py
      (gloo on CPU). Exit status 1 on rank 0 when a grad is left unclipped.
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate


def clipped(mesh, foreach):
    w = torch.nn.Parameter(DTensor.from_local(torch.eye(3, dtype=torch.float64), mesh, [Replicate()], run_check=False))
    x = torch.tensor([[1.0, 0.0, 2.0], [-1.0, 1.0, 1.0]], dtype=torch.float64)
    (x @ w.to_local(grad_placements=[Partial()])).sum().backward()
    full = w.grad.full_tensor().clone()
    total = torch.nn.utils.clip_grad_norm_([w], 1.0, norm_type=1.0, foreach=foreach)
    expected = full * min(1.0, 1.0 / (full.abs().sum().item() + 1e-6))
    return w.grad.placements, total.full_tensor().item(), w.grad.full_tensor(), expected


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank, bad = dist.get_rank(), False
    for foreach in (True, False):
        placements, total, got, expected = clipped(mesh, foreach)
        ok = torch.allclose(got, expected)
        bad |= not ok
        if rank == 0:
            print(f"foreach={foreach}: grad {placements}, total norm {total:g}; clipped grad row 1 "
                  f"{got[1].tolist()} expected {expected[1].tolist()}: {'agrees' if ok else 'UNCLIPPED'}")
    if rank == 0:
        print(f"torch {torch.__version__}: {'DIVERGES' if bad else 'agrees'}")
    dist.destroy_process_group()
    return 1 if bad and rank == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
