"""One weight used twice (x @ w @ w) under a DeepSpeed engine with
gradient_accumulation_steps 2 (2 ranks, gloo, CPU): the full grad at the
accumulation boundary against float64 eager. torch and DeepSpeed only.

gradfuzz versions found ZeRO stage 2 keeping only the last micro-step's grad
on DeepSpeed 0.17.6 (0.16.9 and 0.19.8 agree). Usage:
    STAGE=2 python benchmarks/deepspeed_zero_accumulation.py     (STAGE 0..3, GAS=2)
"""
import os
import sys

import torch
import torch.multiprocessing as mp

GAS = int(os.environ.get("GAS", "2"))
STAGE = int(os.environ.get("STAGE", "2"))


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randint(-2, 3, (3, 3), generator=g).float())

    def forward(self, x):
        return x @ self.w @ self.w


def data(rank, k):
    g = torch.Generator().manual_seed(100 * rank + k)
    return torch.randint(-2, 3, (2, 3), generator=g).float(), torch.randint(-2, 3, (2, 3), generator=g).float()


def worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    deepspeed.init_distributed(dist_backend="gloo")
    m = M()
    eng, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.0), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GAS, "zero_optimization": {"stage": STAGE},
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9})
    got = None
    for k in range(GAS):
        x, c = data(rank, k)
        eng.backward((eng(x) * c).sum() * world * GAS)  # undoes the mean over ranks and micro-steps
        if k == GAS - 1:
            got = safe_get_full_grad(eng.module.w).tolist()
        eng.step()
    q.put((rank, got))


def main():
    world = 2
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, world, 29733, q)) for r in range(world)]
    [p.start() for p in ps]
    got = dict(q.get(timeout=600) for _ in ps)
    [p.join() for p in ps]
    ref = M().double()
    for r in range(world):
        for k in range(GAS):
            x, c = data(r, k)
            (ref(x.double()) * c.double()).sum().backward()
    bad = [r for r in range(world) if not torch.allclose(torch.tensor(got[r], dtype=torch.float64), ref.w.grad)]
    for r in bad:
        print(f"rank {r}: w.grad {got[r]}\n  expected {ref.w.grad.tolist()}")
    import deepspeed
    print(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}, ZeRO {STAGE}, GAS {GAS}: "
          f"{'WRONG' if bad else 'agrees'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
