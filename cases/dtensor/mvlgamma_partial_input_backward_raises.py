"""torch.mvlgamma(x, 1) on a DTensor whose placement is Partial(sum): the
forward reduces it and runs; the backward raises in ATen's mvlgamma_backward,
whose shifted arguments (a one-element arange + x) stay Partial and are then
written by an in-place digamma_ ('in-place operations that require placement
changes are not supported'). At p >= 2 the arange has p elements and the
same backward raises earlier, on any placement (a plain tensor added to a
DTensor). On gloo with two ranks. Exit status 1 when it raises.
Run: python THIS_FILE"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial


def run(rank, world, failed):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    x = (torch.arange(6, dtype=torch.float64).reshape(2, 3) / 4 + 2).requires_grad_()
    eager, = torch.autograd.grad(torch.mvlgamma(x, 1).sum(), x)
    d = DTensor.from_local(x / world, mesh, [Partial("sum")], run_check=False)  # rank pieces that sum to x
    try:
        out = torch.mvlgamma(d, 1)
        print(f"rank {rank}: forward ok, placements {out.placements}")
        got, = torch.autograd.grad(out.full_tensor().sum(), x)
        print(f"rank {rank}: backward ok, grad matches eager's: {torch.allclose(got * world, eager)}")
    except Exception as e:
        print(f"rank {rank}: raised {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        failed.value = 1
    dist.destroy_process_group()


if __name__ == "__main__":
    print("torch", torch.__version__)
    failed = mp.get_context("spawn").Value("i", 0)
    mp.spawn(run, args=(2, failed), nprocs=2)
    print("DIVERGES: the backward raises where eager's runs" if failed.value else "agrees")
    sys.exit(failed.value)
