#!/usr/bin/env python
"""gradfuzz repro: see TITLE below.

Expected: eager autograd in float64. Actual: DeepSpeed's pipeline engine, the module cut in 2 stages
(Stage0, Stage1 below) on 2 ranks, one a rank, ZeRO stage 0, in float32 (CONFIG below);
tied across the stages with TiedLayerSpec: w0.
Schedule: 1 step(s), each one engine.train_batch over 1 microbatch(es);
grads read with deepspeed.utils.safe_get_full_grad as the engine's optimizer is about to step, on the rank
holding each parameter.
Run:  torchrun --master-addr 127.0.0.1 --nproc-per-node 2 THIS_FILE   (gloo on CPU with DS_ACCELERATOR=cpu; nccl with a GPU per rank)
Exit status 1 on rank 0 when they differ.
"""
import json
import os
import sys

import torch
import torch.distributed as dist


TITLE = "DeepSpeed pipeline engine: the tied weight's in-place all-reduce also writes into another parameter's grad that autograd made a view of the same buffer"
PREFIX = 'p_'
CONFIG = json.loads('{"gradient_accumulation_steps": 1, "gradient_clipping": 0.0, "steps_per_print": 1000000000, "train_micro_batch_size_per_gpu": 1, "wall_clock_breakdown": false, "zero_allow_untested_optimizer": true, "zero_optimization": {"stage": 0}}')
STAGE_TIED = [['w0'], ['w0']]  # per stage: its TiedLayerSpec weights, in order
DTYPE = torch.float32
PARAMS = {'w0': [[3.0, -3.0, -1.0], [1.0, 2.0, -2.0], [1.0, 2.0, -3.0]], 'w1': [[-1.0, 3.0, 3.0], [0.0, -3.0, 2.0], [2.0, 2.0, -2.0]]}
FROZEN = set()
PREFILL = None
GRAD_INIT, MICROBATCHES, STEPS, ZERO_GRAD = 'none', 1, 1, 'set_to_none'
CLIP, MAX_NORM = '', 1.0
INPUT_NAMES = ['x0']
INPUT_GRAD = {'x0': True}
INPUTS = [  # one dict per backward
    {'x0': [[0.0, 3.0, 3.0], [0.0, -1.0, -3.0]]},
]
GRAD_OUTPUTS = [  # the grad of each output, one list per backward
    [[[1.0, 1.0, 1.0], [1.0, -3.0, 1.0]]],
]


def forward(v):
    p_n0 = v['x0'] @ v['w0']
    p_n1 = torch.stack([v['w0'], v['w1']], dim=0)
    p_n2 = p_n1.sum(dim=0)
    p_n3 = p_n0 @ p_n2
    return [p_n3]


class Stage0(torch.nn.Module):
    """Stage 0: receives x0, w0."""

    def __init__(self):
        super().__init__()

    def forward(self, a0, a1):
        p_n0 = a0 @ a1
        return p_n0


class Stage1(torch.nn.Module):
    """Stage 1: receives n0, w0."""

    def __init__(self):
        super().__init__()
        self.p_w1 = torch.nn.Parameter(torch.tensor(PARAMS['w1'], dtype=DTYPE), requires_grad='w1' not in FROZEN)

    def forward(self, a0, a1):
        p_n1 = torch.stack([a1, self.p_w1], dim=0)
        p_n2 = p_n1.sum(dim=0)
        p_n3 = a0 @ p_n2
        return p_n3


STAGES = [Stage0, Stage1]


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


def differs(rank, k, name, e, a, shape):
    """1 (and what differs, printed) when grad ``a`` is not eager's ``e``; None reads as zeros."""
    e = torch.zeros(shape, dtype=torch.float64) if e is None else e
    a = torch.zeros(shape, dtype=torch.float64) if a is None else a.to("cpu", torch.float64)
    if torch.allclose(a, e, rtol=1e-5, atol=1e-5 * max(1.0, float(e.abs().max()) if e.numel() else 1.0)):
        return 0
    print(f"rank {rank} backward {k}: {name}.grad differs\n  expected {e.tolist()}\n  actual   {a.tolist()}")
    return 1


def verdict(bad, device, versions):
    flag = torch.tensor([bad], device=device)
    dist.all_reduce(flag)
    if dist.get_rank() == 0:
        print(f"{versions}: {'DIVERGES' if flag.item() else 'agrees'} ({int(flag.item())} differences)")
    dist.barrier()  # no rank tears gloo down while another is still using it (an abort at exit)
    dist.destroy_process_group()
    return 1 if flag.item() else 0


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def identity(x):
    return x


class Holder(torch.nn.Module):
    """A tied parameter's copy on one stage, under the attribute TiedLayerSpec all-reduces by default (weight)."""

    def __init__(self, name):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(PARAMS[name], dtype=DTYPE), requires_grad=name not in FROZEN)
        self.weight.case_name = name


def append_weight(holder, x):
    """A tied layer's forward: the activations, then its weight (the stage's nodes take it last)."""
    return (*as_tuple(x), holder.weight)


class Body(torch.nn.Module):
    """STAGES[i] taking its inputs as the one value the engine hands a layer (a tuple when several)."""

    def __init__(self, i):
        super().__init__()
        self.stage = STAGES[i]()
        for name, p in self.stage.named_parameters():
            p.case_name = name[len(PREFIX):]

    def forward(self, x):
        return self.stage(*as_tuple(x))


def layers():
    """Each stage's tied layers then its body, padded at the front so the uniform partition cuts between them."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    stages = [[TiedLayerSpec(n, Holder, n, forward_fn=append_weight) for n in tied] + [LayerSpec(Body, i)]
              for i, tied in enumerate(STAGE_TIED)]
    width = max(len(s) for s in stages)
    return [layer for s in stages for layer in [identity] * (width - len(s)) + s]


def loss_fn(outputs, cots):
    """sum(output * grad output) times the microbatches: the engine divides the loss by its accumulation steps."""
    terms = [(o * c).sum() for o, c in zip(as_tuple(outputs), cots) if o.requires_grad]
    return MICROBATCHES * sum(terms[1:], terms[0])


def batches(ks):
    """What train_batch draws per microbatch: the inputs (for the first stage), the grad outputs as labels
    (for the last)."""
    for k in ks:
        xs = tuple(torch.tensor(INPUTS[k][n], dtype=DTYPE) for n in INPUT_NAMES)
        yield xs[0] if len(xs) == 1 else xs, tuple(torch.tensor(c, dtype=DTYPE) for c in GRAD_OUTPUTS[k])


def read_before_step(engine, grads, read):
    """Read this rank's grads as the engine settled them (tied ones all-reduced), as its optimizer is about
    to step: the engine zeroes them before train_batch returns."""
    step = engine.optimizer.step

    def reading_step(*args, **kwargs):
        grads.append({n: None if g is None else g.detach().clone() for n, g in read().items()})
        return step(*args, **kwargs)

    engine.optimizer.step = reading_step


def main():
    _gradfuzz_loopback()
    world = int(os.environ["WORLD_SIZE"])
    if world != len(STAGES):
        sys.exit(f"run on {len(STAGES)} ranks (--nproc-per-node {len(STAGES)}): one pipeline stage a rank")
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if gpus else "cpu")  # read when deepspeed is imported
    dist.init_process_group("nccl" if gpus else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.utils import safe_get_full_grad

    deepspeed.init_distributed()  # over the process group above
    module = PipelineModule(layers(), num_stages=len(STAGES), loss_fn=loss_fn, partition_method="uniform")
    params = {p.case_name: p for p in module.parameters() if hasattr(p, "case_name")}  # this rank's stage
    opt = torch.optim.SGD([p for p in params.values() if p.requires_grad], lr=0.0)  # weights stay put
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=CONFIG)
    grads = []
    read_before_step(engine, grads, lambda: {n: safe_get_full_grad(p) for n, p in params.items() if p.requires_grad})
    want, bad = expected(), 0
    for s in range(STEPS):
        engine.train_batch(iter(batches(range(s * MICROBATCHES, (s + 1) * MICROBATCHES))))
        k = (s + 1) * MICROBATCHES - 1  # the window's last backward
        for n, p in params.items():
            bad += differs(rank, k, n, want[k][n], grads[s].get(n), p.shape)
    return verdict(bad, device, f"torch {torch.__version__}, deepspeed {deepspeed.__version__}")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: in the interpreter's teardown gloo's threads sometimes abort
    # the process (SIGABRT, "terminate called without an active exception", even
    # after destroy_process_group), and the exit status would be the abort's.
    os._exit(code)

