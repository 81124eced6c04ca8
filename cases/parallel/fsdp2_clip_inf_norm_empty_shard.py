#!/usr/bin/env python
"""gradfuzz repro: see TITLE below.

Expected: eager autograd in float64. Actual: the module under fully_shard
on 2 rank(s), in float64, switches in OPTIONS.
Schedule: 1 step(s) x 1 microbatch(es), .grad starts 'none',
zero_grad between steps: 'set_to_none'; grads compared after each window's last backward.
Run:  torchrun --nproc-per-node 2 THIS_FILE   (gloo on CPU; nccl with a GPU per rank)
Exit status 1 on rank 0 when they differ.
"""
import contextlib
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

class PassThrough(torch.autograd.Function):
    """The identity, whose backward hands autograd's incoming grad on as the
    very same tensor: downstream, a grad that arrives untouched from the
    caller's grad output is what an implementation adopting autograd's
    tensor as ``.grad`` aliases (the founding graphed bug's class)."""

    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, g):
        return g


TITLE = 'fsdp2.stock'
KIND = 'fsdp2'
OPTIONS = []
DTYPE = torch.float64
PARAMS = {'w0': [[-1.17204915182185, -0.39288424313877424, 0.5264794654391638], [1.1065098684809027, 0.9272747371123735, -1.7420606491853965], [-0.7699140277208829, 0.786438430050321, -1.9962516762426026]], 'b1': [[1.0075974331466206, 1.6677818125087136, -1.5393466196246277]], 'w2': [[0.5369338312116217, 0.948503434813587, -0.20258915000439415], [0.9552587534112702, 1.844174755488463, -0.9636752366141726], [-1.2653159933780966, -1.0969124151557998, 0.8455538368436504]]}
FROZEN = set()
PREFILL = None
GRAD_INIT, MICROBATCHES, STEPS, ZERO_GRAD = 'none', 1, 1, 'set_to_none'
CLIP, MAX_NORM = 'inf', 1.0
INPUT_NAMES = ['x0']
INPUT_GRAD = {'x0': True}
INPUTS = [  # one dict per backward
    {'x0': [[2.0064739765094797, 1.9534658673383687, 0.15171341775447222]]},
]
GRAD_OUTPUTS = [  # the grad of each output, one list per backward
    [[[1.9011443241904638, 0.2687694171158447, -1.3015479938865164]]],
]


def forward(v):
    n0 = v['x0'] @ v['w0']
    n1 = n0 + v['b1']
    n2 = n1 @ v['w0']
    n3 = n2 @ v['w2']
    n4 = PassThrough.apply(n3)
    return [n4]


def start(k):
    return k and k % MICROBATCHES == 0 and ZERO_GRAD != "keep"


def expected():
    params = {n: torch.tensor(t, dtype=torch.float64).requires_grad_(n not in FROZEN) for n, t in PARAMS.items()}
    acc = {n: None for n in params}
    if GRAD_INIT != "none":
        acc = {n: (torch.zeros_like(params[n]) if GRAD_INIT == "zero" else torch.tensor(PREFILL[n], dtype=torch.float64))
               if n not in FROZEN else None for n in params}
    seen = []
    for k in range(MICROBATCHES * STEPS):
        if start(k):
            acc = {n: None if ZERO_GRAD == "set_to_none" or g is None else torch.zeros_like(g) for n, g in acc.items()}
        inputs = {n: torch.tensor(t, dtype=torch.float64).requires_grad_(INPUT_GRAD[n]) for n, t in INPUTS[k].items()}
        cots = [torch.tensor(c, dtype=torch.float64) for c in GRAD_OUTPUTS[k]]
        live = [(o, c) for o, c in zip(forward({**params, **inputs}), cots) if o.requires_grad]
        names = [n for n in params if n not in FROZEN]
        if live and names:
            grads = torch.autograd.grad([o for o, _ in live], [params[n] for n in names], [c for _, c in live],
                                        allow_unused=True)
            for n, g in zip(names, grads):
                if g is not None:
                    acc[n] = g if acc[n] is None else acc[n] + g
        if CLIP and (k + 1) % MICROBATCHES == 0:
            leaves = [torch.zeros_like(params[n]) for n in acc if acc[n] is not None]
            for leaf, g in zip(leaves, [g for g in acc.values() if g is not None]):
                leaf.grad = g
            torch.nn.utils.clip_grad_norm_(leaves, MAX_NORM, norm_type=float(CLIP), foreach=False)
        seen.append({n: None if g is None else g.clone() for n, g in acc.items()})
    return seen


class Module(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        for n, t in PARAMS.items():
            self.register_parameter(n, torch.nn.Parameter(torch.tensor(t, dtype=DTYPE, device=device),
                                                          requires_grad=n not in FROZEN))

    def forward(self, *inputs):
        return tuple(forward({**dict(self.named_parameters()), **dict(zip(INPUT_NAMES, inputs))}))


def main():
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    module = Module(device)
    if KIND == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(
            module, device_ids=[rank] if device.type == "cuda" else None,
            bucket_cap_mb=1e-6 if "small_buckets" in OPTIONS else 25,
            gradient_as_bucket_view="bucket_view" in OPTIONS, static_graph="static_graph" in OPTIONS,
            find_unused_parameters="find_unused" in OPTIONS)
        if "hook_allreduce" in OPTIONS:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        elif "hook_builtin" in OPTIONS:
            model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    else:
        from torch.distributed.fsdp import fully_shard
        reshard = False if "keep_unsharded" in OPTIONS else 1 if "reshard_int" in OPTIONS else True
        model = fully_shard(module, mesh=init_device_mesh(device.type, (world,)), reshard_after_forward=reshard)
    params = dict(module.named_parameters())
    if GRAD_INIT != "none":
        for n, p in params.items():
            if n not in FROZEN:
                full = torch.zeros(p.shape, dtype=DTYPE) if GRAD_INIT == "zero" else torch.tensor(PREFILL[n], dtype=DTYPE)
                full = full.to(device)
                p.grad = (DTensor.from_local(torch.chunk(full, world)[rank] if rank < len(torch.chunk(full, world))
                                             else full[:0], p.device_mesh, p.placements, shape=full.shape, stride=full.stride())
                          if isinstance(p, DTensor) else full)
    want, bad = expected(), 0
    for k in range(MICROBATCHES * STEPS):
        if start(k):
            model.zero_grad(set_to_none=ZERO_GRAD == "set_to_none")
        sync = "no_sync" not in OPTIONS or (k + 1) % MICROBATCHES == 0
        inputs = [torch.tensor(INPUTS[k][n], dtype=DTYPE, device=device).requires_grad_(INPUT_GRAD[n]) for n in INPUT_NAMES]
        cots = [torch.tensor(c, dtype=DTYPE, device=device) * (world if rank == 0 else 0) for c in GRAD_OUTPUTS[k]]
        if KIND == "ddp":
            window = contextlib.nullcontext() if sync else model.no_sync()
        else:
            model.set_requires_gradient_sync(sync)
            if "no_reshard_after_backward" in OPTIONS:
                model.set_reshard_after_backward(sync)
            window = contextlib.nullcontext()
        with window:
            live = [(o, c) for o, c in zip(model(*inputs), cots) if o.requires_grad]
            if live:
                torch.autograd.backward([o for o, _ in live], [c for _, c in live])
        if not sync:
            continue
        if CLIP:
            torch.nn.utils.clip_grad_norm_([p for p in params.values() if p.grad is not None], MAX_NORM,
                                           norm_type=float(CLIP))
        for n, p in params.items():
            e, g = want[k][n], p.grad
            a = None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g).to("cpu", torch.float64)
            same = (e is None and a is None) or (e is not None and a is not None and torch.allclose(a, e, rtol=1e-5, atol=1e-5))
            if not same:
                bad += 1
                print(f"rank {rank} backward {k}: {n}.grad differs\n  expected {None if e is None else e.tolist()}"
                      f"\n  actual   {None if a is None else a.tolist()}")
    flag = torch.tensor([bad], device=device)
    dist.all_reduce(flag)
    if rank == 0:
        print(f"torch {torch.__version__}: {'DIVERGES' if flag.item() else 'agrees'} ({int(flag.item())} differences)")
    del model, params  # DDP's reducer joins its threads here, not in a destructor at exit (an abort there)
    gc.collect()
    dist.barrier()  # no rank tears gloo down while another is still using it (an abort at exit)
    dist.destroy_process_group()
    return 1 if flag.item() else 0


if __name__ == "__main__":
    sys.exit(main())

