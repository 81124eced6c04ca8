"""megatron-core DDP with overlap_grad_reduce=True and a trainable parameter
the forward never uses (2 ranks, gloo, CPU): the second iteration's
zero_grad_buffer() raises a bare AssertionError, where torch's own DDP
(find_unused_parameters=True) and plain accumulation train on.

gradfuzz's megatron.ddp.stock found it in its first 10-minute cold fuzz
(megatron-core 0.16.1, torch 2.13.0). The bucket group records, in its
first iteration, which parameters got a grad, and asserts that every
parameter did; upstream: NVIDIA/Megatron-LM#1150 (open, labelled bug), the
same mechanism seen as "Communication call has not been issued for this
bucket". With OVERLAP=0 the same loop runs and its grads match eager.
Usage:
    python benchmarks/megatron_unused_param_overlap.py        (OVERLAP=0 to compare)
"""
import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OVERLAP = os.environ.get("OVERLAP", "1") == "1"


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randint(-2, 3, (3, 3), generator=g).float())
        self.unused = torch.nn.Parameter(torch.zeros(3, 3))  # trainable, never in the forward

    def forward(self, x):
        return x @ self.w


def worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.cuda.current_device = lambda: "cpu"  # megatron allocates its grad buffers here
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    model = DistributedDataParallel(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1),
                                    DistributedDataParallelConfig(overlap_grad_reduce=OVERLAP), M())
    try:
        for it in range(2):
            model.zero_grad_buffer()
            x = torch.full((2, 3), float(rank + 1 + it))
            model(x).sum().backward()
            finalize_model_grads([model])
            # eager: d/dw sum(x @ w) = x^T 1, averaged over ranks
            want = sum(torch.full((2, 3), float(r + 1 + it)).T @ torch.ones(2, 3) for r in range(world)) / world
            q.put((rank, it, "ok" if torch.equal(model.module.w.main_grad, want) else "grads differ from eager"))
    except AssertionError:
        q.put((rank, it, "AssertionError in " + traceback.extract_tb(__import__("sys").exc_info()[2])[-1].name))
    dist.destroy_process_group()


if __name__ == "__main__":
    world, q = 2, mp.get_context("spawn").Queue()
    mp.spawn(worker, args=(world, 29561, q), nprocs=world, join=True)
    for _ in range(2 * world):
        try:
            print(*q.get(timeout=1))
        except Exception:
            break
