#!/usr/bin/env python
"""gradfuzz repro: see TITLE below.

Expected: eager autograd in float64. Actual: the module under a DeepSpeed engine, ZeRO stage 1,
on 2 rank(s), in float32, accumulation driven 'torch' (CONFIG below).
Schedule: 1 step(s) x 2 microbatch(es); grads read with
deepspeed.utils.safe_get_full_grad at each accumulation boundary.
Run:  torchrun --master-addr 127.0.0.1 --nproc-per-node 2 THIS_FILE   (gloo on CPU with DS_ACCELERATOR=cpu; nccl with a GPU per rank)
Exit status 1 on rank 0 when they differ.
"""
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist


TITLE = 'DeepSpeed loss.backward() with an output computed from another output: the grad through both is divided by the accumulation steps twice (ZeRO 1 and 2)'
PREFIX = 'p_'
DRIVE = 'torch'
MISUSE = ''  # how the loop drives the engine against DeepSpeed's docs ('': as documented)
STEP_EVERY_MICRO_STEP = True
CONFIG = json.loads('{"gradient_accumulation_steps": 2, "steps_per_print": 1000000000, "train_micro_batch_size_per_gpu": 1, "wall_clock_breakdown": false, "zero_allow_untested_optimizer": true, "zero_optimization": {"contiguous_gradients": true, "overlap_comm": false, "reduce_scatter": true, "stage": 1}}')
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
    [[[1.0, 1.0, 1.0], [1.0, -3.0, 1.0]], [[2.0, 2.0, 1.0], [2.0, 3.0, 3.0]]],
    [[[-1.0, -3.0, 1.0], [1.0, 1.0, -1.0]], [[3.0, 3.0, 3.0], [-3.0, 2.0, -1.0]]],
]


def forward(v):
    p_n0 = v['x0'] @ v['w0']
    p_n1 = p_n0 @ v['w0']
    return [p_n1, p_n0]


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
                    acc[n] = g.clone() if acc[n] is None else acc[n] + g  # autograd.grad may hand back views of one buffer
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
        for n, t in PARAMS.items():  # under PREFIX + n, never n itself: it may be "cuda"
            self.register_parameter(PREFIX + n, torch.nn.Parameter(torch.tensor(t, dtype=DTYPE, device=device),
                                                                   requires_grad=n not in FROZEN))

    def weights(self):
        return {n: getattr(self, PREFIX + n) for n in PARAMS}

    def forward(self, *inputs):
        return tuple(forward({**self.weights(), **dict(zip(INPUT_NAMES, inputs))}))


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
    world = int(os.environ["WORLD_SIZE"])
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if gpus else "cpu")  # read when deepspeed is imported
    dist.init_process_group("nccl" if gpus else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    module = Module(device)
    params = module.weights()
    opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.0)  # weights stay put
    engine, optimizer, *_ = deepspeed.initialize(model=module, optimizer=opt, config=CONFIG)
    gas = CONFIG["gradient_accumulation_steps"]
    want, bad = expected(), 0
    for k in range(MICROBATCHES * STEPS):
        boundary = (k + 1) % MICROBATCHES == 0
        if DRIVE == "manual":
            engine.set_gradient_accumulation_boundary(boundary)
        if MISUSE == "zero_grad":
            engine.zero_grad()
        elif MISUSE == "optimizer_zero_grad":
            optimizer.zero_grad()
        inputs = [torch.tensor(INPUTS[k][n], dtype=DTYPE, device=device).requires_grad_(INPUT_GRAD[n]) for n in INPUT_NAMES]
        cots = [torch.tensor(c, dtype=DTYPE, device=device) * (world if rank == 0 else 0) for c in GRAD_OUTPUTS[k]]
        live = [(o, c) for o, c in zip(engine(*inputs), cots) if o.requires_grad]
        if live:
            loss = sum((o * c).sum() for o, c in live) * gas  # the engine divides by its accumulation steps
            if DRIVE == "torch":
                loss.backward()  # PyTorch-style: the engine's output hooks divide by its accumulation steps
            elif MISUSE == "backward_twice":
                engine.backward(loss / 2, retain_graph=True)
                engine.backward(loss / 2)
            else:
                with engine.no_sync() if DRIVE == "nosync" and not boundary else contextlib.nullcontext():
                    engine.backward(loss)
        if boundary:
            for n, p in params.items():
                # safe_get_full_grad reads ZeRO's flat buffers, which hold zeros for a parameter without a grad
                e = want[k][n] if want[k][n] is not None else torch.zeros(p.shape, dtype=torch.float64)
                g = safe_get_full_grad(p) if p.requires_grad else None
                a = torch.zeros(p.shape, dtype=torch.float64) if g is None else g.to("cpu", torch.float64)
                if not torch.allclose(a, e, rtol=1e-5, atol=1e-5):
                    bad += 1
                    print(f"rank {rank} backward {k}: {n}.grad differs\n  expected {e.tolist()}\n  actual   {a.tolist()}")
        if STEP_EVERY_MICRO_STEP or boundary:
            engine.step()
    flag = torch.tensor([bad], device=device)
    dist.all_reduce(flag)
    if rank == 0:
        print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}: "
              f"{'DIVERGES' if flag.item() else 'agrees'} ({int(flag.item())} differences)")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if flag.item() else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: in the interpreter's teardown gloo's threads sometimes abort
    # the process (SIGABRT, "terminate called without an active exception", even
    # after destroy_process_group), and the exit status would be the abort's.
    os._exit(code)

