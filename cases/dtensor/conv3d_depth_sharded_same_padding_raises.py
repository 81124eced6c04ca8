# Two DTensor ops that run on one rank and raise on two (gloo, CPU), where
# eager runs: conv3d(padding="same") on an input sharded along depth, and
# an in-place scatter_add_ into a row-sharded self followed by backward.
import os, torch, torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh

def attempt(rank, what, fn):
    try:
        fn()
        print(f"rank {rank} {what}: ok", flush=True)
    except RuntimeError as e:
        print(f"rank {rank} {what}: raised {str(e).splitlines()[0][:150]}", flush=True)

def run(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29571")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    rep = lambda t: DTensor.from_local(t, mesh, [Replicate()], run_check=False)
    g = torch.Generator().manual_seed(0)

    def conv():
        x = torch.randn(1, 1, 4, 4, 4, generator=g, dtype=torch.float64, requires_grad=True)
        w, b = torch.randn(1, 1, 1, 1, 1, dtype=torch.float64), torch.randn(1, dtype=torch.float64)
        xd = rep(x).redistribute(mesh, [Shard(2)])
        torch.nn.functional.conv3d(xd, rep(w), rep(b), padding="same").full_tensor().sum().backward()

    def scatter():
        x = torch.randn(10, 5, generator=g, dtype=torch.float64, requires_grad=True)
        idx = torch.randint(0, 10, (5, 5), generator=g)
        src = torch.randn(5, 5, dtype=torch.float64)
        xd = rep(x * 1.0).redistribute(mesh, [Shard(0)])
        out = xd.scatter_add_(0, rep(idx), rep(src))
        out.full_tensor().sum().backward()

    attempt(rank, "conv3d depth-sharded", conv)
    attempt(rank, "scatter_add_ into Shard(0) self", scatter)
    dist.destroy_process_group()

if __name__ == "__main__":
    print("torch", torch.__version__)
    mp.spawn(run, args=(2,), nprocs=2)
