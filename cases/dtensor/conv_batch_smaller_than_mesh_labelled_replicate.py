# DTensor: a convolution whose input batch dim (size 1) is Shard(0) over 2 ranks
# returns a DTensor labelled Replicate() whose local tensors differ per rank
# (rank 1 holds an empty (0, C, L) tensor): full_tensor() and every consumer
# then see different "replicas". Batch 2 (even) is right (Shard(0) output).
import os, torch, torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh

def run(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29562")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 3, 3, generator=g, dtype=torch.float64)
    rep = lambda t: DTensor.from_local(t, mesh, [Replicate()], run_check=False)
    for name, f in (("conv1d", torch.nn.functional.conv1d), ("conv_transpose1d", torch.nn.functional.conv_transpose1d)):
        for batch in (1, 2):
            x = torch.randn(batch, 3, 4, generator=torch.Generator().manual_seed(batch), dtype=torch.float64)
            out = f(rep(x).redistribute(mesh, [Shard(0)]), rep(w))
            print(f"rank {rank} {name} batch {batch}: placements {out.placements}, local shape "
                  f"{tuple(out.to_local().shape)}, eager shape {tuple(f(x, w).shape)}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    print("torch", torch.__version__)
    mp.spawn(run, args=(2,), nprocs=2)
