"""megatron-core DDP with the distributed optimizer's reduce-scatter and a
parameter marked ``shared_embedding`` (as GPT/LanguageModule mark a tied
embedding) that is not the first in the grad buffer (2 ranks, gloo, CPU).

gradfuzz's megatron.distopt.stock found it on megatron-core 0.12.3 (clean on
0.16.1). The shared parameter is meant to start a bucket of its own: 0.12.3
closes the previous bucket at a padded end but leaves the parameter's start
where it was, so its main_grad view lies in the previous bucket's padding,
outside the bucket it is listed in (which is empty). With
overlap_grad_reduce the bucket holding its values is reduced as soon as its
own listed parameters are ready, before the shared parameter's grad is
added, and the empty bucket it is listed in reduces nothing: the reduced
grad the optimizer reads is wrong. Without overlap everything is reduced at
the end and the values happen to be right. This script prints the layout
and whether the owned shards of the reduced buffer hold the eager grad.
Usage (in an environment with megatron-core installed):
    python benchmarks/megatron_shared_embedding_bucket.py      (OVERLAP=0 to compare)
"""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OVERLAP = os.environ.get("OVERLAP", "1") == "1"


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randint(-2, 3, (3, 3), generator=g).float())  # tied: used twice
        self.w = torch.nn.Parameter(torch.randint(-2, 3, (3, 3), generator=g).float())

    def forward(self, x):
        return x @ self.emb @ self.emb @ self.w


def eager(world):
    m = M()
    for r in range(world):
        m(torch.full((2, 3), float(r + 1))).sum().backward()
    return {n: p.grad / world for n, p in m.named_parameters()}


def worker(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.cuda.current_device = lambda: "cpu"  # megatron allocates its grad buffers here
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    module = M()
    module.emb.shared_embedding = True
    model = DistributedDataParallel(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1),
                                    DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=OVERLAP), module)
    model.zero_grad_buffer()
    model(torch.full((2, 3), float(rank + 1))).sum().backward()
    finalize_model_grads([model])
    buf = model.buffers[0]
    shards = [buf.grad_data.clone() for _ in range(world)]
    dist.all_gather(shards, buf.grad_data.clone())
    owned = buf.grad_data.clone()  # every bucket's reduced shard, from the rank that owns it
    for b in buf.buckets:
        n = b.grad_data.numel() // world
        for r in range(world):
            owned[b.offset + r * n:b.offset + (r + 1) * n] = shards[r][b.offset + r * n:b.offset + (r + 1) * n]
    if rank == 0:
        want = eager(world)
        print("megatron-core", megatron.core.__version__, "overlap_grad_reduce", OVERLAP)
        print("buckets", buf.bucket_indices)
        for name, p in module.named_parameters():
            start, end, bucket = buf.param_index_map[p]
            got = owned[start:end].view(p.shape)
            print(f"{name}: buffer [{start}, {end}) listed in bucket {bucket}; reduced grad "
                  f"{'matches' if torch.allclose(got, want[name]) else 'DIFFERS from'} eager")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, 29563), nprocs=2, join=True)
