"""Standalone repro scripts: the thing a person pastes into an upstream report.

The script imports only torch (plus the machinery under test), spells the
module out as plain torch code, embeds the data, runs the eager oracle and
the machinery side by side and prints expected against actual. Paths
describe their machinery as a ``Repro`` value (``path.repro(case)``), so the
script shows exactly the calls the harness made.
"""

from __future__ import annotations

from harness.materialize.tensors import Built
from harness.case.spec import Case
from harness.materialize.source import checked, forward_source, function_helpers, literal
from harness.paths import families
from harness.paths.base import Repro
from harness.paths.family import ScriptWriter


def _writers() -> dict[str, ScriptWriter]:
    return {t: w for f in families() for t, w in f.scripts.items()}


def script(case: Case, path_name: str, machinery: Repro, title: str = "") -> str:
    """The full text of a standalone repro for ``case`` on ``path_name``.

    ``machinery`` is the path's ``repro(case)``: its template picks the
    script's shape (``harness.paths.base.Repro``). The ``schedule`` and
    ``none`` templates are written here; a family's own (pipeline stages,
    torchrun ranks) come from its ``Family.scripts``. Every
    value of the case is checked first and text (title, path name) goes in
    through ``repr`` only: corpus files and Redis items come from strangers.
    """
    case = checked(case)
    title, path_name = str(title), str(path_name)
    writer = _writers().get(machinery.template)
    if writer is not None:
        return writer(case, machinery, title or path_name)
    b = Built(case)
    sched = case.schedule
    helpers = function_helpers(case)
    imports, body = machinery.imports, machinery.backward
    if machinery.template == "none" or not body:
        why = machinery.why or f"{path_name} describes no standalone machinery"
        body = f"    raise SystemExit({(why + '; replay the corpus file with gradfuzz repro')!r})\n"
    wrapped = machinery.forward or 'DEVICE = "cpu"\nmachinery_forward = forward\n'
    data = _constants(case, b, title, path_name)
    header = f'''#!/usr/bin/env python
"""gradfuzz repro: see TITLE and PATH below.

Expected: eager autograd in float64 (torch.autograd.grad per backward,
summed out of place). Actual: the machinery of PATH, in {case.dtype}.
Schedule: {sched.steps} step(s) x {sched.microbatches} microbatch(es), grads start as
{sched.grad_init!r}, zero_grad between steps: {sched.zero_grad!r}.
Run with plain python; exit status 1 when they differ. The loop keeps every
earlier .grad and input grad and checks they never change (as gradfuzz
does: a .grad is checked against its value where its step ended, once
zero_grad has run); --no-hold runs it keeping none.
"""
import sys

import torch
{imports}
'''
    return "\n".join([header, *helpers, "", *data, "", "", forward_source(case), "", "", wrapped, "",
                      _RUNNER.replace("%BODY%", body), ""])


def _constants(case: Case, b: Built, title: str, path_name: str) -> list[str]:
    """The case's values as the script's constants: a report's reader runs
    the script without gradfuzz, the corpus file or its seed."""
    sched = case.schedule
    params = b.params()
    return [
        f"TITLE = {title or path_name!r}",
        f"PATH = {path_name!r}  # the machinery under test",
        f"DTYPE = torch.{case.dtype}",
        "PARAMS = {" + ", ".join(f"{n!r}: {literal(t)}" for n, t in params.items()) + "}",
        "FROZEN = " + repr({p.name for p in case.params if not p.requires_grad} or set()),
        f"GRAD_INIT = {sched.grad_init!r}  # state of every .grad before the first backward",
        "PREFILL = {" + ", ".join(f"{n!r}: {literal(t)}" for n, t in b.prefill().items()) + "}",
        f"MICROBATCHES, STEPS, ZERO_GRAD = {sched.microbatches}, {sched.steps}, {sched.zero_grad!r}",
        f"CLIP, MAX_NORM = {sched.clip!r}, {sched.max_norm!r}  # clip_grad_norm_ after each window ('' = none)",
        f"OPTIMIZER = {sched.optimizer!r}  # the case's optimizer step: not spelled out here ('' = none)",
        "INPUT_GRAD = " + repr({x.name: x.requires_grad for x in case.inputs}),
        "INPUTS = [  # one dict per backward",
        *[
            "    {" + ", ".join(f"{n!r}: {literal(t)}" for n, t in b.inputs(k).items()) + "},"
            for k in range(sched.backwards)
        ],
        "]",
        "GRAD_OUTPUTS = [  # the grad of each output, one list per backward",
        *["    [" + ", ".join(literal(c) for c in b.cotangents(k)) + "]," for k in range(sched.backwards)],
        "]",
    ]


_RUNNER = '''def leaves(dtype, k, device="cpu"):
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
%BODY%

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
            # The step's .grad tensors were written by design (accumulated in place, clipped, zeroed, or let go
            # by set_to_none): what the user holds of them now is the new baseline, as gradfuzz refreshes its own.
            held = [(what, t, before if what in changed or not owner else t.detach().clone(), *owner)
                    for what, t, before, *owner in held]
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
    sys.exit(main())'''
