#!/usr/bin/env python
"""gradfuzz repro: see TITLE below.

Expected: eager autograd in float64 over the whole model (torch.autograd.grad
per microbatch, summed out of place). Actual: torch.distributed.pipelining
ScheduleZBVZeroBubble over 2 PipelineStage(s) on 1 rank(s) (gloo, CPU), in
float32, loss = sum(output * grad_output) per microbatch, scale_grads=False.
Schedule: 1 step(s) x 1 microbatch(es), grads start as
'none', zero_grad between steps: 'set_to_none'. A parameter used by
several stages has a copy in each; its grad is the sum of the copies'.
Run with plain python; exit status 1 when they differ.
"""
import multiprocessing
import os
import pickle
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.pipelining import ScheduleZBVZeroBubble as Schedule
from torch.distributed.pipelining import PipelineStage as Stage  # torch as installed


TITLE = 'pipeline.ZBVZeroBubble.stock: w0 after backward 0: 9 of 9 elements differ'
DTYPE = torch.float32
PARAMS = {'w0': [[3.0, -3.0, -1.0], [1.0, 2.0, -2.0], [1.0, 2.0, -3.0]]}
FROZEN = set()
GRAD_INIT = 'none'  # state of every .grad before the first step (a tied copy: None/zeros)
PREFILL = {'w0': [[2.0, -1.0, -2.0], [-3.0, -3.0, -3.0], [2.0, -3.0, 3.0]]}
MICROBATCHES, STEPS, ZERO_GRAD = 1, 1, 'set_to_none'
INPUT_GRAD = {'x0': True}
INPUTS = [  # one dict per microbatch, over all steps
    {'x0': [[0.0, 3.0, 3.0], [0.0, -1.0, -3.0]]},
]
GRAD_OUTPUTS = [  # the grad of each model output, one list per microbatch
    [[[1.0, 1.0, 1.0], [1.0, -3.0, 1.0]]],
]
WORLD_SIZE = 1
PLACEMENT = [0, 0]  # the rank of each stage, as ZBVZeroBubble places them
STAGE_PARAMS = [['w0'], ['w0']]


def forward(v):
    p_n0 = v['x0'] @ v['w0']
    p_n1 = p_n0 @ v['w0']
    if p_n1.requires_grad:
        p_n1.register_hook(lambda g: g * 2)  # a scale hook
    return [p_n1]


class Stage0(torch.nn.Module):
    """Stage 0: receives x0."""

    def __init__(self):
        super().__init__()
        self.p_w0 = torch.nn.Parameter(torch.tensor(PARAMS['w0'], dtype=DTYPE), requires_grad='w0' not in FROZEN)

    def forward(self, a0):
        p_n0 = a0 @ self.p_w0
        return p_n0


class Stage1(torch.nn.Module):
    """Stage 1: receives n0."""

    def __init__(self):
        super().__init__()
        self.p_w0 = torch.nn.Parameter(torch.tensor(PARAMS['w0'], dtype=DTYPE), requires_grad='w0' not in FROZEN)

    def forward(self, a0):
        p_n1 = a0 @ self.p_w0
        if p_n1.requires_grad:
            p_n1.register_hook(lambda g: g * 2)  # a scale hook
        return p_n1


STAGES = [Stage0, Stage1]


def expected():
    """Per step: each parameter's accumulated grad; per microbatch: each input's grad."""
    params = {n: torch.tensor(t, dtype=torch.float64).requires_grad_(n not in FROZEN) for n, t in PARAMS.items()}
    names = [n for n in params if n not in FROZEN]
    acc = {n: None if GRAD_INIT == "none" or n in FROZEN else
           torch.zeros_like(params[n]) if GRAD_INIT == "zero" else torch.tensor(PREFILL[n], dtype=torch.float64)
           for n in params}
    steps, input_grads = [], []
    for s in range(STEPS):
        if s and ZERO_GRAD != "keep":
            acc = {n: None if ZERO_GRAD == "set_to_none" or g is None else torch.zeros_like(g) for n, g in acc.items()}
        for k in range(s * MICROBATCHES, (s + 1) * MICROBATCHES):
            inputs = {n: torch.tensor(t, dtype=torch.float64).requires_grad_(INPUT_GRAD[n]) for n, t in INPUTS[k].items()}
            cots = [torch.tensor(c, dtype=torch.float64) for c in GRAD_OUTPUTS[k]]
            live = [(o, c) for o, c in zip(forward({**params, **inputs}), cots) if o.requires_grad]
            wrt = names + [n for n in inputs if INPUT_GRAD[n]]
            got = dict(zip(wrt, torch.autograd.grad([o for o, _ in live], [params[n] if n in params else inputs[n] for n in wrt],
                                                    [c for _, c in live], allow_unused=True))) if live and wrt else {}
            for n in names:
                if got.get(n) is not None:
                    acc[n] = got[n] if acc[n] is None else acc[n] + got[n]
            input_grads.append({n: got.get(n) for n in inputs})
        steps.append({n: None if g is None else g.clone() for n, g in acc.items()})
    return steps, input_grads


def loss_fn(output, target):
    outs = output if isinstance(output, (tuple, list)) else (output,)
    row = target.reshape(-1)
    cots, at = [], 1
    for c in GRAD_OUTPUTS[int(row[0])]:
        size = torch.tensor(c).numel()
        cots.append(row[at:at + size].reshape(torch.tensor(c).shape))
        at += size
    terms = [(o * c).sum() for o, c in zip(outs, cots) if o.requires_grad]
    return sum(terms[1:], terms[0])


def watch_sends(found):
    """torch.distributed.isend leaves a tensor written before its request
    completes undefined, and what the peer then receives depends on timing.
    Each sent tensor's version counter is noted when the schedule posts the
    send and compared when it waits for it: a write shows on every run."""
    from torch.distributed.pipelining import schedules
    if not hasattr(schedules, "_batch_p2p") or not hasattr(schedules, "_wait_batch_p2p"):
        return
    post, wait, pending = schedules._batch_p2p, schedules._wait_batch_p2p, {}

    def posting(ops, *a, **kw):
        works = post(ops, *a, **kw)
        pending[id(works)] = (works, [(op.tensor, op.tensor._version, op.peer) for op in ops if op.op is dist.isend])
        return works

    def waiting(works, *a, **kw):
        for t, version, peer in pending.pop(id(works), (None, []))[1]:
            if t._version != version:
                found["inflight"].append(f"a tensor of shape {tuple(t.shape)} sent to rank {peer} was written in place "
                                         f"before its send was waited (version {version} -> {t._version})")
        return wait(works, *a, **kw)

    schedules._batch_p2p, schedules._wait_batch_p2p = posting, waiting


def actual(rank, store_path, results):
    """One rank: its stages, the schedule, STEPS calls of step()."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD_SIZE), rank=rank, world_size=WORLD_SIZE)
    found = {"rank": rank, "steps": [], "input_grads": [], "error": None, "inflight": []}
    watch_sends(found)
    try:
        mine = [i for i, r in enumerate(PLACEMENT) if r == rank]
        modules = {i: STAGES[i]() for i in mine}
        first_copy = {}
        for i, names in enumerate(STAGE_PARAMS):
            for n in names:
                first_copy.setdefault(n, i)
        for i, m in modules.items():
            for n, p in zip(STAGE_PARAMS[i], m.parameters()):
                if p.requires_grad and GRAD_INIT != "none":
                    p.grad = torch.tensor(PREFILL[n], dtype=DTYPE) if GRAD_INIT == "prefilled" and first_copy[n] == i \
                        else torch.zeros_like(p)
        stages = [Stage(modules[i], i, len(STAGES), torch.device("cpu")) for i in mine]
        if issubclass(Schedule, torch.distributed.pipelining.schedules.PipelineScheduleSingle):  # one stage per rank
            schedule = Schedule(stages[0], MICROBATCHES, loss_fn=loss_fn, scale_grads=False)
        else:
            schedule = Schedule(stages, MICROBATCHES, loss_fn=loss_fn, scale_grads=False)
        for s in range(STEPS):
            ks = range(s * MICROBATCHES, (s + 1) * MICROBATCHES)
            if s:
                for m in modules.values():
                    for p in m.parameters():
                        if ZERO_GRAD == "set_to_none":
                            p.grad = None
                        elif ZERO_GRAD == "zeros" and p.grad is not None:
                            p.grad.zero_()
            args, kwargs = [], {}
            if 0 in mine:
                for n in INPUT_GRAD:
                    args.append(torch.cat([torch.tensor(INPUTS[k][n], dtype=DTYPE) for k in ks]).requires_grad_(INPUT_GRAD[n]))
            if len(STAGES) - 1 in mine:
                kwargs["target"] = torch.tensor([[float(k)] + [x for c in GRAD_OUTPUTS[k] for x in torch.tensor(c).reshape(-1).tolist()]
                                                 for k in ks], dtype=DTYPE)
            schedule.step(*args, return_outputs=False, **kwargs)
            found["steps"].append({(i, n): None if p.grad is None else p.grad.detach().double().clone()
                                   for i, m in modules.items() for n, p in zip(STAGE_PARAMS[i], m.parameters())})
            if 0 in mine:
                found["input_grads"] += [{n: None if t.grad is None else t.grad.detach().double().chunk(MICROBATCHES)[j]
                                          for n, t in zip(INPUT_GRAD, args)} for j in range(MICROBATCHES)]
    except Exception as e:
        import traceback
        traceback.print_exc()
        found["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}" + \
            (f" (caused by {type(e.__cause__).__name__}: {str(e.__cause__).strip().splitlines()[0]})" if e.__cause__ else "")
    # Plain bytes: a Queue hands tensors over as shared memory that the sender
    # must outlive, and a rank that exits at once lost its result now and then.
    results.put(pickle.dumps(found))
    dist.destroy_process_group()


def run_ranks():
    store = os.path.join(tempfile.mkdtemp(), "store")
    if WORLD_SIZE == 1:
        import queue
        results = queue.Queue()
        actual(0, store, results)
        return [pickle.loads(results.get())]
    ctx = multiprocessing.get_context("spawn")  # not fork: a child forked from a process that ran torch ops can hang on a lock some thread held
    results = ctx.Queue()
    procs = [ctx.Process(target=actual, args=(r, store, results)) for r in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    got = []
    for _ in procs:
        try:
            got.append(pickle.loads(results.get(timeout=180)))  # a loaded CI machine: ranks start slowly
        except Exception:
            break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if len(got) < WORLD_SIZE:
        got.append({"rank": None, "steps": [], "input_grads": [], "error": "a rank hung or died (timeout)", "inflight": []})
    return got


def main():
    want, want_inputs = expected()
    got = run_ranks()
    bad = 0
    for g in got:
        if g["error"]:
            bad += 1
            print(f"rank {g['rank']}: the schedule raised {g['error']}; eager autograd ran this fine")
        for w in g.get("inflight", []):
            bad += 1
            print(f"rank {g['rank']}: {w}: undefined for isend, so the values below may agree on one run and not the next")
    done = min(len(g["steps"]) for g in got)
    for s in range(done):
        total = {n: None for n in PARAMS}
        for g in got:
            for (i, n), t in g["steps"][s].items():
                if t is not None:
                    total[n] = t if total[n] is None else total[n] + t
        for n in PARAMS:
            e, a = want[s][n], total[n]
            same = (e is None and (a is None or not a.any())) or (e is not None and a is not None and torch.allclose(a, e, rtol=1e-5, atol=1e-5))
            print(f"step {s}: {n}.grad {'agrees' if same else 'DIFFERS'}")
            if not same:
                bad += 1
                print(f"  expected {None if e is None else e.tolist()}")
                print(f"  actual   {None if a is None else a.tolist()}")
                if e is not None and a is not None and float((e * e).sum()) > 0:
                    print(f"  ratio actual/expected {float((a * e).sum() / (e * e).sum()):.4g}")
    first = next((g for g in got if g["input_grads"]), None)
    if first is not None:
        for k, grads in enumerate(first["input_grads"]):
            for n, a in grads.items():
                e = want_inputs[k][n]
                if (e is None) != (a is None) or (e is not None and not torch.allclose(a, e, rtol=1e-5, atol=1e-5)):
                    bad += 1
                    print(f"microbatch {k}: grad of input {n} differs: expected {None if e is None else e.tolist()}, "
                          f"actual {None if a is None else a.tolist()}")
    print(f"torch {torch.__version__}: {'DIVERGES' if bad else 'agrees'} ({bad} problem(s))")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
