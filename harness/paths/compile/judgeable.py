"""Keep a float64 dense structure within what its tolerance can judge.

A float32 case in tolerance mode is judged against the float32 noise eager
itself shows (``Tolerance.with_noise``); a float64 case (the training steps
run in float64) has no such measure, since float64 eager is the oracle, and
is judged by its term bounds alone: ``eps * bound + eps * 1e-3 * peak``, the
peak being the largest term bound anywhere in the case
(``magnitude_bounds``). Each OpInfo node multiplies the grad bounds that
flow through it by ``1 + K * m`` (``opinfo.bound``), so a chain of the
family's dense ops took the peak of half its float64 structures past 1e14,
where the floor alone is larger than the grads and a zeroed grad agrees.

``within_budget`` runs after everything else is drawn: a float64 case
whose peak is over ``PEAK_BUDGET`` has its OpInfo nodes take their ops'
gentlest samples and, if that is not enough, loses the fewest of them
that bring it within (those that grow the bounds most; a node's uses then
read its input), found by bisection: a few ``magnitude_bounds`` calls of
tens of milliseconds each, on a structure that compiles for seconds.
Where the structure without any OpInfo node is over the budget already,
the ops are not what hides its grads: they stay, and the training step
goes, so the case is float32 and eager's noise judges it. The step draws
nothing, so a case shrinks as before; float32 cases, where nearly every
dense structure is judged, keep every op.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from hypothesis import strategies as st

from harness.case import opinfo
from harness.case.spec import Case, Node, Schedule, Use
from harness.case.validate import infer_shapes
from harness.case.vocab import SpecError

# At this peak the floor ``eps * 1e-3 * peak`` of a float64 case is 2.8e-4
# (eps = 2**-52 * SLACK), an element at the peak allowed 0.28. Measured on
# 2.13 (docs/detection.md): no float64 dense structure under 1e14 had a
# zeroed grad agree, 39 of the 61 over it did; at 1e14 itself a wrong grad
# still agreed in 14 of 249 cases, at 1e13 in 6, at 1e12 in 8, which also
# dropped more ops.
PEAK_BUDGET = 1e13


def peak(case: Case) -> float:
    """The largest term bound of ``case`` (what the tolerance's floor scales with)."""
    from harness.materialize.tensors import magnitude_bounds

    return float(magnitude_bounds(case)["__peak__"])


def growth(call: tuple, m: int) -> tuple[float, float]:
    """How an OpInfo node with ``call`` on an input of ``m`` elements grows
    the bounds: (the factor on the grads through it, the value it adds),
    read from ``opinfo.bound`` itself."""
    h = torch.zeros(max(m, 1), dtype=torch.float64, requires_grad=True)
    out = opinfo.bound([h], {"call": call})
    (g,) = torch.autograd.grad(out.sum(), h)
    return float(g.max()), float(out.detach().max())


def gentlest(key: str, call: tuple, m: int) -> tuple:
    """The sample of op ``key`` that grows the bounds least on ``m`` elements
    (``call`` where no other sample grows them less)."""
    samples = opinfo.table()[key]["samples"] if key in opinfo.table() else ()
    return min((call, *samples), key=lambda c: growth(c, m))


def _without(case: Case, name: str) -> Case:
    """``case`` less node ``name``, whose uses read its own input (``case``
    itself where a hook or a retained grad names the node)."""
    if name in case.retain_grad or any(h.node == name for h in case.hooks):
        return case
    node = next(n for n in case.nodes if n.name == name)
    src = node.args[0]

    def use(u: Use) -> Use:
        return replace(u, ref=src.ref, index=src.index, transpose=u.transpose != src.transpose) \
            if u.ref == name else u

    nodes = tuple(replace(n, args=tuple(use(u) for u in n.args)) for n in case.nodes if n.name != name)
    out = replace(case, nodes=nodes, outputs=tuple(use(u) for u in case.outputs))
    try:
        infer_shapes(out)
    except SpecError:
        return case
    return out


def _sizes(case: Case) -> dict[str, int]:
    """Each OpInfo node's input size, by node name."""
    known = infer_shapes(case)
    return {n.name: math.prod(known[n.args[0].ref] or (1,)) for n in case.nodes if n.op == "opinfo"}


def _softened(case: Case) -> Case:
    """``case`` with every OpInfo node on its op's gentlest sample."""
    sizes = _sizes(case)

    def soft(n: Node) -> Node:
        if n.op != "opinfo":
            return n
        call = gentlest(n.attr("fn"), n.attr("call"), sizes[n.name])
        if call == n.attr("call"):
            return n
        return replace(n, attrs=tuple((k, call if k == "call" else v) for k, v in n.attrs if k != "place"))

    return replace(case, nodes=tuple(soft(n) for n in case.nodes))


def _dropped(case: Case, names: list[str]) -> Case:
    for name in names:
        case = _without(case, name)
    return case


def untrained(case: Case) -> Case:
    """``case`` without its training step, in float32 (the dtype a case
    has before ``training_steps`` draws one), where eager's noise judges it."""
    s = case.schedule
    if not (s.clip or s.optimizer):
        return case
    default = Schedule()
    return replace(case, dtype="float32", schedule=replace(
        s, clip="", max_norm=default.max_norm, optimizer="", optimizer_impl="", lr=default.lr))


def gentled(case: Case, budget: float = PEAK_BUDGET) -> Case:
    """``case`` within ``budget`` (see the module's doc): its OpInfo nodes on
    their gentlest samples, then the fewest of them dropped, those that grow
    the grad bounds most first; where the case without them is over
    ``budget`` already, the ops are not what hides its grads: every op
    stays and the training step goes (``untrained``)."""
    if case.exact or case.dtype != "float64" or not any(n.op == "opinfo" for n in case.nodes):
        return case
    if peak(case) <= budget:
        return case
    soft = _softened(case)
    if peak(soft) <= budget:
        return soft
    sizes = _sizes(soft)
    order = sorted((n for n in soft.nodes if n.op == "opinfo"),
                   key=lambda n: growth(n.attr("call"), sizes[n.name]), reverse=True)
    names = [n.name for n in order]
    if peak(_dropped(soft, names)) > budget:
        return untrained(case)
    lo, hi = 0, len(names)  # dropping the first hi is within budget, the first lo is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak(_dropped(soft, names[:mid])) <= budget:
            hi = mid
        else:
            lo = mid
    return _dropped(soft, names[:hi])


def within_budget(case: Case) -> st.SearchStrategy[Case]:
    """The draw step: ``gentled(case)``, drawing nothing."""
    return st.just(gentled(case))
