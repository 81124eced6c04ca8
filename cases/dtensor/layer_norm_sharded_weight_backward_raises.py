#!/usr/bin/env python
"""gradfuzz repro: layer_norm with a Shard(0) DTensor gain raises in backward (torch < 2.13).

F.layer_norm(x, (3,), g) with g a Shard(0) DTensor parameter (sharded along
the normalized dim) and x Replicate: the forward replicates the weight and
runs, but 2.11's native_layer_norm_backward strategy hands the local kernel
the weight's own shard ([2] on rank 0, [1] on rank 1), which raises
"Expected weight to be of same shape as normalized_shape". 2.13 agrees with
eager autograd.
Run:  torchrun --nproc-per-node 2 THIS_FILE   (gloo on CPU)
Exit status 1 on rank 0 when the weight grad is wrong or backward raises.
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    x, g, gy = torch.randn(2, 3), torch.randn(3), torch.randn(2, 3)
    g_ref = g.clone().requires_grad_()
    torch.nn.functional.layer_norm(x, (3,), g_ref).backward(gy)

    gd = torch.nn.Parameter(distribute_tensor(g, mesh, [Shard(0)]))
    xd = distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
    try:
        y = torch.nn.functional.layer_norm(xd, (3,), gd)
        y.backward(distribute_tensor(gy, mesh, [Replicate()]))
        got = gd.grad.full_tensor()
        bad = not torch.allclose(got, g_ref.grad, atol=1e-5)
        what = f"weight grad {'differs' if bad else 'agrees'}: {got.tolist()} vs eager {g_ref.grad.tolist()}"
    except RuntimeError as e:
        bad, what = True, f"backward raised RuntimeError: {e}"
    if dist.get_rank() == 0:
        print(f"torch {torch.__version__}: {'DIVERGES' if bad else 'agrees'}: {what}")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
