#!/usr/bin/env python
"""gradfuzz repro: see TITLE below.

Expected: eager autograd in float64 over the whole model (torch.autograd.grad
per microbatch, summed out of place). Actual: torch.distributed.pipelining
ScheduleDualPipeV over 4 PipelineStage(s) on 2 rank(s) (gloo, CPU), in
float32, loss = sum(output * grad_output) per microbatch, scale_grads=False.
Schedule: 1 step(s) x 4 microbatch(es), grads start as
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
from torch.distributed.pipelining import ScheduleDualPipeV as Schedule
from torch.distributed.pipelining import PipelineStage as Stage  # torch as installed


TITLE = 'DualPipeV on two ranks: the view steal and the split drop stacked (w1 = g1 + 2*g2 + 2*g3)'
DTYPE = torch.float32
PARAMS = {'w0': [[-1.17204915182185, -0.39288424313877424, 0.5264794654391638], [1.1065098684809027, 0.9272747371123735, -1.7420606491853965], [-0.7699140277208829, 0.786438430050321, -1.9962516762426026]], 'w1': [[1.0075974331466206, 1.6677818125087136, -1.5393466196246277], [-0.30380924343197085, -1.3198387720754698, 2.1827758705964238], [-0.6406170876181244, -0.18715842921739573, -1.7284419783824305]], 'w2': [[0.5369338312116217, 0.948503434813587, -0.20258915000439415], [0.9552587534112702, 1.844174755488463, -0.9636752366141726], [-1.2653159933780966, -1.0969124151557998, 0.8455538368436504]]}
FROZEN = set()
GRAD_INIT = 'none'  # state of every .grad before the first step (a tied copy: None/zeros)
PREFILL = {'w0': [[-0.5073209626283688, 0.28140323796980254, -0.22562661122290517], [0.41732344988639525, 0.2402541707367198, -1.3500890978001634], [-0.492214880675544, 0.056921185721221276, 0.15919617725314913]], 'w1': [[-0.3029720077661885, 2.053317224696696, -2.3318580027482176], [-0.6351708470528039, -1.40559026147937, -0.167900933768795], [-0.7166798292324624, -1.344954754533248, 0.4721432157669576]], 'w2': [[-1.7866702662757945, 0.6542844641860678, 1.1203296196325794], [-0.609170783759657, -0.19574953979934775, -0.5412095979577666], [0.8348688614705057, 0.01203715083327638, -1.4463531087592807]]}
MICROBATCHES, STEPS, ZERO_GRAD = 4, 1, 'set_to_none'
INPUT_GRAD = {'x0': False}
INPUTS = [  # one dict per microbatch, over all steps
    {'x0': [[2.0064739765094797, 1.9534658673383687, 0.15171341775447222], [-0.42691325176738654, -0.5058797219017293, -0.772283368054093]]},
    {'x0': [[-0.18327825902617031, -0.6933469291185893, -2.16673311387655], [-0.6615334368115311, 0.739625564084815, -1.0775681593099669]]},
    {'x0': [[0.06742172469972728, 1.916582470181478, -0.8375467626246054], [-0.9895194112817008, 0.5192663324613866, -0.6534793192245834]]},
    {'x0': [[-0.24516415548606352, -0.24343533893451536, 0.5477306510749104], [0.3975062611484384, -0.8657396480581442, 0.3054511451603976]]},
]
GRAD_OUTPUTS = [  # the grad of each model output, one list per microbatch
    [[[1.9011443241904638, 0.2687694171158447, -1.3015479938865164], [-0.002156557243019393, 1.450130981503286, -0.8284369374662465]]],
    [[[-0.7813729369041318, -1.255588058492969, -1.3769893330868916], [0.24815856407479664, -1.0441522906853105, -0.10220369534059276]]],
    [[[-0.8055536947161954, 0.17640411972593217, -0.23737590594473593], [0.061595703660084815, -0.06699605066994789, -1.0970770677149204]]],
    [[[-0.4107325036943621, -0.38046746731534054, 0.2775496569124178], [0.2371016219361929, -0.7737309322164669, -1.532376016072959]]],
]
WORLD_SIZE = 2
PLACEMENT = [0, 1, 1, 0]  # the rank of each stage, as DualPipeV places them
STAGE_PARAMS = [['w0'], [], ['w1', 'w2'], ['w0']]


def forward(v):
    p_n0 = v['x0'] @ v['w0']
    p_n1 = torch.nn.functional.gelu(p_n0)
    p_n2 = torch.stack([v['w1'], v['w2']], dim=0)
    p_n3 = p_n2.sum(dim=0)
    p_n4 = v['x0'] @ p_n3
    p_n5 = p_n1 * p_n4
    p_n6 = p_n5 @ v['w0'].mT
    p_n7 = v['x0'] + p_n6
    return [p_n7]


class Stage0(torch.nn.Module):
    """Stage 0: receives x0."""

    def __init__(self):
        super().__init__()
        self.p_w0 = torch.nn.Parameter(torch.tensor(PARAMS['w0'], dtype=DTYPE), requires_grad='w0' not in FROZEN)

    def forward(self, a0):
        p_n0 = a0 @ self.p_w0
        return (a0, p_n0)


class Stage1(torch.nn.Module):
    """Stage 1: receives x0, n0."""

    def __init__(self):
        super().__init__()

    def forward(self, a0, a1):
        p_n1 = torch.nn.functional.gelu(a1)
        return (a0, p_n1)


class Stage2(torch.nn.Module):
    """Stage 2: receives x0, n1."""

    def __init__(self):
        super().__init__()
        self.p_w1 = torch.nn.Parameter(torch.tensor(PARAMS['w1'], dtype=DTYPE), requires_grad='w1' not in FROZEN)
        self.p_w2 = torch.nn.Parameter(torch.tensor(PARAMS['w2'], dtype=DTYPE), requires_grad='w2' not in FROZEN)

    def forward(self, a0, a1):
        p_n2 = torch.stack([self.p_w1, self.p_w2], dim=0)
        p_n3 = p_n2.sum(dim=0)
        p_n4 = a0 @ p_n3
        return (a0, a1, p_n4)


class Stage3(torch.nn.Module):
    """Stage 3: receives x0, n1, n4."""

    def __init__(self):
        super().__init__()
        self.p_w0 = torch.nn.Parameter(torch.tensor(PARAMS['w0'], dtype=DTYPE), requires_grad='w0' not in FROZEN)

    def forward(self, a0, a1, a2):
        p_n5 = a1 * a2
        p_n6 = p_n5 @ self.p_w0.mT
        p_n7 = a0 + p_n6
        return p_n7


STAGES = [Stage0, Stage1, Stage2, Stage3]


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

