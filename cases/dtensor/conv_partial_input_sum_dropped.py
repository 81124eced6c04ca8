"""F.conv1d (and conv_transpose1d) on a DTensor input whose placement is
Partial(sum), with a Replicate weight: sharding propagation asks for the
input as Replicate, but DTensor's convolution handler runs the local
convolution on each rank's own piece and labels the result Replicate, so
the output is one rank's share (half of eager's on two ranks), silently.
The backward then raises: its handler redistributes the Replicate grad
output to the input's Partial placement ('Can not redistribute from R to
P(sum)'). On gloo with two ranks. Exit status 1 when either shows.
Run: python THIS_FILE"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate


def run(rank, world, failed):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29543")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    x = (torch.arange(12, dtype=torch.float64).reshape(1, 3, 4) / 4 - 1).requires_grad_()
    w = torch.arange(27, dtype=torch.float64).reshape(3, 3, 3) / 8 - 1
    eager = F.conv1d(x, w)
    d = DTensor.from_local(x / world, mesh, [Partial("sum")], run_check=False)  # rank pieces that sum to x
    out = F.conv1d(d, DTensor.from_local(w, mesh, [Replicate()], run_check=False))
    full = out.full_tensor()
    print(f"rank {rank}: forward placements {out.placements}, DTensor/eager {float(full.sum() / eager.sum()):.3f}")
    if not torch.allclose(full, eager):
        failed.value = 1
    try:
        torch.autograd.grad(full.sum(), x)
        print(f"rank {rank}: backward ok")
    except Exception as e:
        print(f"rank {rank}: backward raised {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        failed.value = 1
    dist.destroy_process_group()


if __name__ == "__main__":
    print("torch", torch.__version__)
    failed = mp.get_context("spawn").Value("i", 0)
    mp.spawn(run, args=(2, failed), nprocs=2)
    print("DIVERGES: the forward drops the Partial sum, the backward raises" if failed.value else "agrees")
    sys.exit(failed.value)
