"""The ``func.*`` paths in a standalone script: the same transform calls and
the same writes into ``.grad``, in plain torch, on the shared ``schedule``
template (its loop calls ``machinery_forward(v)`` then ``backward(outs,
cots, inputs, params)`` once per microbatch)."""

from __future__ import annotations

import inspect

from harness.case.spec import Case
from harness.paths.func.transforms import func_reach
from harness.paths.base import Repro

# Module-level helpers: harness.paths.func.transforms, spelled out.
HELPERS = '''DEVICE = "cpu"


def func_leaves(params, inputs):
    """Differentiated leaves (trainable, requiring grad) and constants, detached."""
    return ({n: p.detach() for n, p in params.items() if p.requires_grad},
            {n: x.detach() for n, x in inputs.items() if x.requires_grad},
            {n: p.detach() for n, p in params.items() if not p.requires_grad},
            {n: x.detach() for n, x in inputs.items() if not x.requires_grad})


''' + inspect.getsource(func_reach) + '''

def func_loss(frozen, reached):
    """One microbatch's loss, sum((o * c).sum()) over the outputs that need grad; the outputs as aux."""
    def loss(params, inputs, consts, cots):
        outs = forward({**frozen, **consts, **params, **inputs})
        live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
        func_reach([o for o, _ in live], {**params, **inputs}, reached)
        if not live:
            return torch.zeros((), dtype=DTYPE), outs
        return sum(((o * c).sum() for o, c in live[1:]), (live[0][0] * live[0][1]).sum()), outs
    return loss


def func_outputs(frozen, reached):
    """The forward as vjp takes it."""
    def f(params, inputs, consts):
        outs = forward({**frozen, **consts, **params, **inputs})
        func_reach([o for o in outs if o.requires_grad], {**params, **inputs}, reached)
        return outs
    return f


def func_accumulate(params, inputs, gp, gi, reached):
    """Into .grad as AccumulateGrad does: a copy when None, an in-place sum
    otherwise; a leaf the graph does not reach keeps None (unless its grad is not zero)."""
    for n, g in gp.items():
        if n in reached or bool(g.ne(0).any()):
            p = params[n]
            if p.grad is None:
                p.grad = torch.empty_like(p, requires_grad=False).copy_(g)
            else:
                p.grad.add_(g)
    for n, g in gi.items():
        if n in reached or bool(g.ne(0).any()):
            inputs[n].grad = torch.empty_like(inputs[n], requires_grad=False).copy_(g)


def func_split(v):
    return {n: t for n, t in v.items() if n in PARAMS}, {n: t for n, t in v.items() if n not in PARAMS}
'''

FORWARD = {
    "grad": '''

def machinery_forward(v):
    """The outputs the loop sees; grad() runs its own forward in backward."""
    with torch.no_grad():
        return forward(v)
''',
    "vjp": '''

PENDING = []  # the vjp function of the forward just run


def machinery_forward(v):
    params, inputs = func_split(v)
    reached = set()
    ps, xs, frozen, consts = func_leaves(params, inputs)
    outs, fn = torch.func.vjp(func_outputs(frozen, reached), ps, xs, consts)
    PENDING.append((fn, reached))
    return outs
''',
    "vmap": '''

STEP = {"k": -1}  # backward k; at each step's first forward, the whole step under vmap


def machinery_forward(v):
    STEP["k"] += 1
    k = STEP["k"]
    j = k % MICROBATCHES
    if j == 0:
        params, _ = func_split(v)
        ps, _, frozen, _ = func_leaves(params, {})
        batch = [func_leaves({}, leaves(DTYPE, i, DEVICE)[0]) + (leaves(DTYPE, i, DEVICE)[1],)
                 for i in range(k, k + MICROBATCHES)]
        xs = {n: torch.stack([b[1][n] for b in batch]) for n in batch[0][1]}
        consts = {n: torch.stack([b[3][n] for b in batch]) for n in batch[0][3]}
        cots = [torch.stack(cs) for cs in zip(*(b[4] for b in batch))]
        reached = set()
        fn = torch.func.vmap(torch.func.grad(func_loss(frozen, reached), argnums=(0, 1), has_aux=True),
                             in_dims=(None, 0, 0, 0), randomness="same")
        (gp, gi), outs = fn(ps, xs, consts, cots)
        STEP["step"] = (gp, gi, outs, reached)
    return [o[j] for o in STEP["step"][2]]
''',
    "eager": '''

machinery_forward = forward
''',
}

BACKWARD = {
    "grad": '''    reached = set()
    ps, xs, frozen, consts = func_leaves(params, inputs)
    loss = func_loss(frozen, reached)
    (gp, gi), _ = torch.func.grad(loss, argnums=(0, 1), has_aux=True)(ps, xs, consts, cots)
    func_accumulate(params, inputs, gp, gi, reached)
''',
    "vjp": '''    fn, reached = PENDING.pop()
    gp, gi, _ = fn(cots)
    func_accumulate(params, inputs, gp, gi, reached)
''',
    "vmap": '''    gp, gi, _, reached = STEP["step"]
    j = STEP["k"] % MICROBATCHES
    func_accumulate(params, inputs, {n: g[j] for n, g in gp.items()}, {n: g[j] for n, g in gi.items()}, reached)
''',
    "eager": '''    wrt = {**{n: p for n, p in params.items() if p.requires_grad},
           **{n: x for n, x in inputs.items() if x.requires_grad}}
    live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    got = (torch.autograd.grad([o for o, _ in live], list(wrt.values()), [c for _, c in live], allow_unused=True)
           if live and wrt else [None] * len(wrt))
    reached = {n for n, g in zip(wrt, got) if g is not None}
    grads = {n: torch.zeros_like(t) if g is None else g for (n, t), g in zip(wrt.items(), got)}
    func_accumulate(params, inputs, {n: g for n, g in grads.items() if n in params},
                    {n: g for n, g in grads.items() if n in inputs}, reached)
''',
}


def repro(variant: str, case: Case) -> Repro:
    """The standalone machinery of ``func.<variant>`` (the case's own values come from the template)."""
    return Repro(forward=HELPERS + FORWARD[variant], backward=BACKWARD[variant])
