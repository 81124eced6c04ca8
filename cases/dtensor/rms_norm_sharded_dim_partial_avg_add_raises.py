#!/usr/bin/env python
"""gradfuzz repro: F.rms_norm on a DTensor sharded along the normalized dim raises on CPU (aten.add_.Scalar on Partial(avg)).

Expected: eager autograd in float64, summed out of place. Actual: DTensor
parameters on 2 rank(s), grad-layout handling 'stock', in float32.
Schedule: 1 step(s) x 1 microbatch(es), .grad starts as None,
zero_grad between steps: 'set_to_none'.
Run:  torchrun --master-addr 127.0.0.1 --nproc-per-node 2 THIS_FILE   (gloo on CPU; nccl with a GPU per rank; loopback only unless GRADFUZZ_REPRO_ANY_INTERFACE=1)
Exit status 1 on rank 0 when they differ.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor



TITLE = 'dtensor.stock'
PLACEMENT = {'g0': 'shard0'}
LOCAL = False  # every parameter Replicate, used through to_local(grad_placements=[Partial()])
DTYPE = torch.float32
PARAMS = {'g0': [-1.17204915182185, -0.39288424313877424, 0.5264794654391638, 1.1065098684809027]}
FROZEN = set()
PREFILL = None
GRAD_INIT, MICROBATCHES, STEPS, ZERO_GRAD = 'none', 1, 1, 'set_to_none'
CLIP, MAX_NORM = '', 1.0
INPUT_NAMES = ['x0']
INPUT_GRAD = {'x0': True}
INPUTS = [  # one dict per backward
    {'x0': [[2.0064739765094797, 1.9534658673383687, 0.15171341775447222, -0.42691325176738654], [-0.5058797219017293, -0.772283368054093, 2.9906512196846102, 0.436078424917166]]},
]
GRAD_OUTPUTS = [  # the grad of each output, one list per backward
    [[[1.9011443241904638, 0.2687694171158447, -1.3015479938865164, -0.002156557243019393], [1.450130981503286, -0.8284369374662465, 0.896841362877569, 1.2354513931831512]]],
]


def forward(v):
    p_n0 = torch.nn.functional.rms_norm(v['x0'], (v['x0'].shape[-1],), v['g0'], eps=0.01)
    p_n1 = torch.nn.functional.rms_norm(p_n0, (p_n0.shape[-1],), v['g0'], eps=0.01)
    return [p_n1]


def placement(name):
    code = PLACEMENT[name]
    if code.startswith("shard"):
        return Shard(int(code[5:]))
    return Replicate()


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


def _gradfuzz_loopback():
    """Keep this script's sockets on loopback (GRADFUZZ_REPRO_ANY_INTERFACE=1: leave them to the user)."""
    if os.environ.get("GRADFUZZ_REPRO_ANY_INTERFACE") == "1":
        return
    import socket

    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if addr not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"MASTER_ADDR={addr} is not loopback: run with --master-addr 127.0.0.1, "
                 "or set GRADFUZZ_REPRO_ANY_INTERFACE=1 to run across hosts")
    lo = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if lo:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)


def main():
    _gradfuzz_loopback()
    dist.init_process_group("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"]) else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    params = {}
    for n, t in PARAMS.items():
        full = torch.tensor(t, dtype=DTYPE, device=device)
        params[n] = torch.nn.Parameter(distribute_tensor(full, mesh, [Replicate() if LOCAL else placement(n)]),
                                       requires_grad=n not in FROZEN)
    pass
    want, bad = expected(), 0
    for k in range(MICROBATCHES * STEPS):
        if start(k):
            for p in params.values():
                if ZERO_GRAD == "set_to_none":
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
        inputs = {n: torch.tensor(t, dtype=DTYPE, device=device).requires_grad_(INPUT_GRAD[n]) for n, t in INPUTS[k].items()}
        cots = [torch.tensor(c, dtype=DTYPE, device=device) for c in GRAD_OUTPUTS[k]]
        if LOCAL:  # rank 0 holds each grad output, the others zeros: the Partial grads sum to eager's
            values = {n: p.to_local(grad_placements=[Partial()]) for n, p in params.items()}
            cots = [c if rank == 0 else torch.zeros_like(c) for c in cots]
        else:
            values = dict(params)
            inputs = {n: distribute_tensor(t.detach(), mesh, [Replicate()]).requires_grad_(t.requires_grad) for n, t in inputs.items()}
            cots = [distribute_tensor(c, mesh, [Replicate()]) for c in cots]
        outs = forward({**values, **inputs})
        live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
        if live:
            torch.autograd.backward([o for o, _ in live], [c for _, c in live])
        for n, p in params.items():
            e, g = want[k][n], p.grad
            a = None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g).to("cpu", torch.float64)
            same = (e is None and a is None) or (e is not None and a is not None and torch.allclose(a, e, rtol=1e-5, atol=1e-5))
            if not same:
                bad += 1
                if rank == 0:
                    print(f"backward {k}: {n}.grad differs\n  expected {None if e is None else e.tolist()}\n  actual   {None if a is None else a.tolist()}")
            if LOCAL and isinstance(g, DTensor) and not any(pl.is_partial() for pl in g.placements):
                bad += 1
                if rank == 0:
                    print(f"backward {k}: {n}.grad is {g.placements}, expected Partial: the grads reached AccumulateGrad as Partial")
    if rank == 0:
        print(f"torch {torch.__version__}: {'DIVERGES' if bad else 'agrees'} ({bad} differences)")
    dist.barrier()  # no rank tears gloo down while another is still using it (an abort at exit)
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

