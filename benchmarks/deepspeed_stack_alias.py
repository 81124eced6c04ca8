"""Two weights used as torch.stack([w0, w1]).sum(0) under a DeepSpeed engine
(2 ranks, gloo, CPU): full grads against float64 eager.

gradfuzz's deepspeed.zero3.stock found it (reduce_bucket_size 8, one
micro-step). This script, torch and DeepSpeed only, diverges at stages 0 to
3 with "stack" and agrees with "add" (w0 + w1); gradfuzz's own stage 0 to 2
paths agree on its case. The difference between the two is not yet
understood, so it is not a ledger entry. Usage:
    python benchmarks/deepspeed_stack_alias.py BUCKET stack|add   (STAGE=0..3, SAMEX=1, CLONE=1)
"""
import os, sys
import torch
import torch.multiprocessing as mp

BUCKET = int(sys.argv[1]) if len(sys.argv) > 1 else 8
STACK = (sys.argv[2] if len(sys.argv) > 2 else "stack") == "stack"

class M(torch.nn.Module):
    def __init__(s):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        s.w0 = torch.nn.Parameter(torch.randint(-2, 3, (4, 4), generator=g).float())
        s.w1 = torch.nn.Parameter(torch.randint(-2, 3, (4, 4), generator=g).float())
    def forward(s, x):
        w = torch.stack([s.w0, s.w1]).sum(0) if STACK else s.w0 + s.w1
        return x @ w

def data(rank):
    g = torch.Generator().manual_seed(1 + (0 if os.environ.get("SAMEX") else rank))
    return torch.randint(-2, 3, (2, 4), generator=g).float(), torch.randint(-2, 3, (2, 4), generator=g).float()

def worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    deepspeed.init_distributed(dist_backend="gloo")
    m = M()
    if os.environ.get("CLONE"):
        for p in m.parameters():
            p.register_hook(lambda g: g.clone())  # each grad its own storage
    zero = {"stage": int(os.environ.get("STAGE", "3"))}
    if BUCKET:
        zero.update(reduce_bucket_size=BUCKET, allgather_bucket_size=max(BUCKET, 2))
    eng, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.0), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero,
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9})
    x, c = data(rank)
    eng.backward((eng(x) * c).sum() * world)  # the mean over ranks is the sum of both ranks' grads
    q.put((rank, {n: safe_get_full_grad(p).tolist() for n, p in eng.module.named_parameters()}))

if __name__ == "__main__":
    world = 2
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, world, 29711, q)) for r in range(world)]
    [p.start() for p in ps]
    got = dict(q.get(timeout=300) for _ in ps)
    [p.join() for p in ps]
    ref = M().double()
    for r in range(world):
        x, c = data(r)
        (ref(x.double()) * c.double()).sum().backward()
    bad = 0
    for n, p in ref.named_parameters():
        for r in range(world):
            ok = torch.allclose(torch.tensor(got[r][n], dtype=torch.float64), p.grad)
            bad += not ok
            if not ok:
                print(f"rank {r} {n}.grad differs\n  expected {p.grad.tolist()}\n  actual   {got[r][n]}")
    import deepspeed
    print(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}, bucket {BUCKET or 'default'}, "
          f"{'stack' if STACK else 'add'}: {'DIVERGES' if bad else 'agrees'}")
    sys.exit(1 if bad else 0)
