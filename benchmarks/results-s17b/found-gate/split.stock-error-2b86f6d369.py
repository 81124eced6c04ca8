#!/usr/bin/env python
"""gradfuzz repro: see TITLE and PATH below.

Expected: eager autograd in float64 (torch.autograd.grad per backward,
summed out of place). Actual: the machinery of PATH, in float32.
Schedule: 1 step(s) x 1 microbatch(es), grads start as
'none', zero_grad between steps: 'set_to_none'.
Run with plain python; exit status 1 when they differ. The loop keeps every
earlier .grad and input grad and checks they never change (as gradfuzz
does); --no-hold runs it keeping none.
"""
import sys

import torch
import torch.distributed.pipelining._backward as split_impl


TITLE = 'split.stock: raised RuntimeError: element 1 of tensors does not require grad and does not have a grad_fn (the eager oracle ran this case fine)'
PATH = 'split.stock'  # the machinery under test
DTYPE = torch.float32
PARAMS = {'w0': [[3.0, -3.0, -1.0], [1.0, 2.0, -2.0], [1.0, 2.0, -3.0]]}
FROZEN = set()
GRAD_INIT = 'none'  # state of every .grad before the first backward
PREFILL = {'w0': [[2.0, -1.0, -2.0], [-3.0, -3.0, -3.0], [2.0, -3.0, 3.0]]}
MICROBATCHES, STEPS, ZERO_GRAD = 1, 1, 'set_to_none'
CLIP, MAX_NORM = '', 1.0  # clip_grad_norm_ after each window ('' = none)
OPTIMIZER = ''  # the case's optimizer step: not spelled out here ('' = none)
INPUT_GRAD = {'x0': True, 'x1': False}
INPUTS = [  # one dict per backward
    {'x0': [[0.0, 3.0, 3.0], [0.0, -1.0, -3.0]], 'x1': [[-1.0, -1.0, -2.0], [2.0, -2.0, 2.0]]},
]
GRAD_OUTPUTS = [  # the grad of each output, one list per backward
    [[[1.0, 1.0, 1.0], [1.0, -3.0, 1.0]], [[2.0, 2.0, 1.0], [2.0, 3.0, 3.0]]],
]


def forward(v):
    p_n0 = v['x0'] @ v['w0']
    p_n1 = torch.relu(v['x1'])
    return [p_n0, p_n1]


DEVICE = "cpu"
machinery_forward = forward


def leaves(dtype, k, device="cpu"):
    inputs = {n: torch.tensor(t, dtype=dtype, device=device).requires_grad_(INPUT_GRAD[n]) for n, t in INPUTS[k].items()}
    cots = [torch.tensor(c, dtype=dtype, device=device) for c in GRAD_OUTPUTS[k]]
    return inputs, cots


OWN = []  # each backward's own parameter grads, before accumulation (filled by expected())


def expected():
    params = {n: torch.tensor(t, dtype=torch.float64).requires_grad_(n not in FROZEN) for n, t in PARAMS.items()}
    acc = {n: None for n in params}
    if GRAD_INIT != "none":
        for n in params:
            if n not in FROZEN:
                acc[n] = torch.zeros_like(params[n]) if GRAD_INIT == "zero" else torch.tensor(PREFILL[n], dtype=torch.float64)
    seen = []
    for k in range(MICROBATCHES * STEPS):
        if k and k % MICROBATCHES == 0 and ZERO_GRAD != "keep":
            acc = {n: None if ZERO_GRAD == "set_to_none" or g is None else torch.zeros_like(g) for n, g in acc.items()}
        inputs, cots = leaves(torch.float64, k)
        live = [(o, c) for o, c in zip(forward({**params, **inputs}), cots) if o.requires_grad]
        names = [n for n in params if n not in FROZEN]
        if live and names:
            grads = torch.autograd.grad([o for o, _ in live], [params[n] for n in names], [c for _, c in live], allow_unused=True)
            for n, g in zip(names, grads):
                if g is not None:
                    acc[n] = g.clone() if acc[n] is None else acc[n] + g  # autograd.grad may hand back views of one buffer
            OWN.append(dict(zip(names, grads)))
        else:
            OWN.append({})
        if CLIP and (k + 1) % MICROBATCHES == 0:  # clipped in place, as the user's loop clips .grad
            holders = [torch.zeros_like(params[n]) for n in acc if acc[n] is not None]
            for holder, g in zip(holders, [g for g in acc.values() if g is not None]):
                holder.grad = g
            torch.nn.utils.clip_grad_norm_(holders, MAX_NORM, norm_type=float(CLIP), foreach=False)
        seen.append({n: None if g is None else g.clone() for n, g in acc.items()})
    return seen


def backward(outs, cots, inputs, params):
    """The machinery under test: one backward of one microbatch."""
    dinputs, groups = split_impl.stage_backward_input(
        outs, cots, list(inputs.values()), iter(params.values()))
    split_impl.stage_backward_weight(iter(params.values()), groups)


def actual():
    params = {n: torch.nn.Parameter(torch.tensor(t, dtype=DTYPE, device=DEVICE), requires_grad=n not in FROZEN) for n, t in PARAMS.items()}
    if GRAD_INIT != "none":
        for n, p in params.items():
            if n not in FROZEN:
                p.grad = torch.zeros_like(p) if GRAD_INIT == "zero" else torch.tensor(PREFILL[n], dtype=DTYPE, device=DEVICE)
    seen, held, changed = [], [], []
    for k in range(MICROBATCHES * STEPS):
        if k and k % MICROBATCHES == 0:
            for p in params.values():
                if ZERO_GRAD == "set_to_none":
                    p.grad = None
                elif ZERO_GRAD == "zeros" and p.grad is not None:
                    p.grad.zero_()
        inputs, cots = leaves(DTYPE, k, DEVICE)
        # The caller's tensors: nothing may write into them behind its back.
        held += [(f"grad output {i} of backward {k}", c, c.clone()) for i, c in enumerate(cots)]
        held += [(f"input {n} of backward {k}", t, t.detach().clone()) for n, t in inputs.items()]
        backward(machinery_forward({**params, **inputs}), cots, inputs, params)
        for what, t, before, *owner in held:
            if what in changed or (owner and owner[0].grad is t):
                continue  # a .grad still in use is accumulated into, by design
            try:
                same = torch.equal(t.detach(), before)
            except RuntimeError as e:  # the machinery freed or poisoned a tensor the user holds
                changed.append(what)
                print(f"backward {k}: reading {what} raised {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
                continue
            if not same:
                changed.append(what)
                print(f"backward {k}: {what} was changed by the machinery: {before.tolist()} -> {t.detach().tolist()}")
        if HOLD_GRADS:  # grads a user keeps (a log, a running norm): earlier ones must stay as they were
            held += [(f"{n}.grad after backward {k}", p.grad, p.grad.detach().clone(), p) for n, p in params.items() if p.grad is not None]
            held += [(f"grad of input {n} from backward {k}", t.grad, t.grad.detach().clone()) for n, t in inputs.items() if t.grad is not None]
        if CLIP and (k + 1) % MICROBATCHES == 0:
            torch.nn.utils.clip_grad_norm_([p for p in params.values() if p.grad is not None], MAX_NORM,
                                           norm_type=float(CLIP))
        seen.append({n: None if p.grad is None else p.grad.detach().to("cpu", torch.float64, copy=True) for n, p in params.items()})
    return seen, changed


HOLD_GRADS = "--no-hold" not in sys.argv  # --no-hold: the plain loop, keeping no earlier grads


def main():
    if OPTIMIZER:
        print(f"note: the case's {OPTIMIZER!r} optimizer step is not in this script; grads are compared before it "
              "(the corpus file replays the whole step: gradfuzz repro FILE)")
    want = expected()
    try:
        got, changed = actual()
    except Exception as e:  # the machinery raised where eager autograd ran fine
        import traceback
        traceback.print_exc()
        print(f"torch {torch.__version__}: DIVERGES: the machinery raised {type(e).__name__}; eager autograd ran this fine")
        return 1
    bad = len(changed)
    for k, (w, g) in enumerate(zip(want, got)):
        for n in w:
            e, a = w[n], g[n]
            same = (e is None and a is None) or (e is not None and a is not None and torch.allclose(a, e, rtol=1e-5, atol=1e-5))
            if not same:
                bad += 1
                print(f"backward {k}: {n}.grad differs")
                print(f"  expected {None if e is None else e.tolist()}")
                print(f"  actual   {None if a is None else a.tolist()}")
                if e is not None and a is not None and float((e * e).sum()) > 0:
                    print(f"  ratio actual/expected {float((a * e).sum() / (e * e).sum()):.4g}")
                last = OWN[k].get(n) if k < len(OWN) else None
                if a is not None and last is not None and k % MICROBATCHES and float((last * last).sum()) > 0:
                    c = float((a * last).sum() / (last * last).sum())
                    if abs(c - round(c)) < 1e-6 and round(c) > 1 and torch.allclose(a, round(c) * last, rtol=1e-5, atol=1e-5):
                        print(f"  actual = {round(c)} x this backward's own grad g{k + 1} = {last.tolist()}: "
                              f"the last microbatch's grad counted {round(c)} times, earlier ones lost")
    print(f"torch {torch.__version__}: {'DIVERGES' if bad else 'agrees'} ({bad - len(changed)} differing grads, {len(changed)} caller tensors changed)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
