#!/usr/bin/env python
"""gradfuzz repro: see TITLE below.

Expected: eager autograd in float64. Actual: the module under DistributedDataParallel
on 2 rank(s), in float32, switches in OPTIONS.
Schedule: 1 step(s) x 2 microbatch(es), .grad starts 'none',
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


TITLE = 'ddp.stock'
KIND = 'ddp'
OPTIONS = ['no_sync', 'static_graph']
DTYPE = torch.float32
PARAMS = {'w0': [[3.0, -3.0, -1.0], [1.0, 2.0, -2.0], [1.0, 2.0, -3.0]]}
FROZEN = set()
PREFILL = None
GRAD_INIT, MICROBATCHES, STEPS, ZERO_GRAD = 'none', 2, 1, 'set_to_none'
CLIP, MAX_NORM = '', 1.0
INPUT_NAMES = ['x0']
INPUT_GRAD = {'x0': True}
INPUTS = [  # one dict per backward
    {'x0': [[0.0, 3.0, 3.0], [0.0, -1.0, -3.0]]},
    {'x0': [[0.0, 3.0, 0.0], [-3.0, 0.0, -3.0]]},
]
GRAD_OUTPUTS = [  # the grad of each output, one list per backward
    [[[1.0, 1.0, 1.0], [1.0, -3.0, 1.0]]],
    [[[-1.0, -3.0, 1.0], [1.0, 1.0, -1.0]]],
]


def forward(v):
    n0 = v['x0'] @ v['w0']
    return [n0]


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

