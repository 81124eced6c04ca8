"""Canaries: deliberately wrong implementations the harness must catch.

They ship with the package because ``gradfuzz selfcheck`` (and ``gate``,
which runs it first) proves on the user's own installation that detection
still works: a gate that silently lost its teeth after an upgrade must not
pass.

Two wrap torch's stock functions and undo one thing they get right, so each
reproduces a real bug shape exactly; one wraps our fixed implementation.
They are judged relative to their base (the fuzzer counts a case only when
the base agrees with the oracle), so what is caught is the injected bug,
not some other bug the base may have.
"""

from __future__ import annotations


import torch.distributed.pipelining._backward as stock

from harness.paths.family import Canary
from harness.paths.injected import double_count_nested  # noqa: F401  (a canary of this family)
from oracles import split_fixed


def _earliest(intermediates, grads) -> tuple:
    """The intermediate made first (lowest autograd sequence number) and its
    grad, each in a container of its own kind. Stock holds the
    intermediates in set order, which follows memory addresses: keeping
    "the first" of them would drop a different site on every run, and the
    canary would be caught after 3 examples on one run and missed in 300 on
    the next."""
    items = list(intermediates)
    i = min(range(len(items)), key=lambda j: items[j]._sequence_nr())
    like = lambda c, kept: type(c)(kept) if isinstance(c, (set, frozenset, tuple)) else kept  # noqa: E731
    return like(intermediates, [items[i]]), like(grads, [list(grads)[i]])


class loses_tied_site:
    """Keeps only the first place where a weight's paths meet the input path,
    so a weight used at several sites loses all but one."""

    @staticmethod
    def stage_backward_input(*args, **kwargs):
        dinputs, groups = stock.stage_backward_input(*args, **kwargs)
        for g in groups:
            if g.get("grads") is not None and len(g["intermediates"]) > 1:
                # A list from 2.13 on, a set before (its order is the one the grads were made in).
                g["intermediates"], g["grads"] = _earliest(g["intermediates"], g["grads"])
        return dinputs, groups

    stage_backward_weight = staticmethod(stock.stage_backward_weight)


class drops_accumulated:
    """Overwrites .grad in the weight pass, dropping what earlier
    microbatches (or a prefilled grad) accumulated."""

    stage_backward_input = staticmethod(split_fixed.stage_backward_input)

    @staticmethod
    def stage_backward_weight(weights, param_groups, retain_graph=False):
        weights = list(weights)
        saved = {id(w): w.grad for w in weights}
        for w in weights:
            w.grad = None
        out = split_fixed.stage_backward_weight(weights, param_groups, retain_graph)
        for w in weights:
            if w.grad is None:
                w.grad = saved[id(w)]
        return out


CANARIES = {
    "double_count_nested": ("harness.paths.injected:double_count_nested", "split.stock"),
    "loses_tied_site": ("harness.paths.split.canaries:loses_tied_site", "split.stock"),
    "drops_accumulated": ("harness.paths.split.canaries:drops_accumulated", "split.fixed"),
}


def canaries() -> list[Canary]:
    from harness.paths.split.paths import SplitPath

    return [
        Canary(name, lambda name=name, impl=impl: SplitPath(f"canary.{name}", impl, stock_contract=True),
               base, needs_clamp=name == "double_count_nested")
        for name, (impl, base) in CANARIES.items()
    ]
