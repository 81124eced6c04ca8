"""torch.dist(x, y, 2) on a DTensor x whose placement is Partial(sum): the
forward reduces it and runs; the backward (derivatives.yaml: norm_backward of
x - y) raises in norm_backward's own masked_fill_, in place on a Partial
tensor, as torch.norm's backward does. gloo, two ranks. Run: python THIS_FILE"""
import os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate


def run(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29535")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    x = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, 5, dtype=torch.float64)
    d = DTensor.from_local(x / world, mesh, [Partial("sum")], run_check=False)  # pieces that sum to x
    other = DTensor.from_local(y, mesh, [Replicate()], run_check=False)
    try:
        out = torch.dist(d, other, 2)
        print(f"rank {rank}: forward ok, placements {out.placements}, value {out.full_tensor().item():.6f}"
              f" (eager {torch.dist(x, y, 2).item():.6f})")
        out.full_tensor().backward()
        print(f"rank {rank}: backward ok")
    except Exception as e:
        print(f"rank {rank}: raised {type(e).__name__}: {str(e)[:300]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    print(torch.__version__)
    mp.spawn(run, args=(2,), nprocs=2)
