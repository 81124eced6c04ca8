"""What the ``func.*`` paths share: a microbatch's loss as a pure function of
its leaves, the leaves a transform differentiates, and the loop's writes
into ``.grad``.

torch.func differentiates functions, not graphs: it hands back one grad per
argument and never writes ``.grad``. So the paths split a microbatch's
tensors into the leaves the transform differentiates (trainable parameters
and inputs that require grad, detached) and constants (frozen parameters,
inputs that need no grad), evaluate the case's forward over them as a dict
(``functional_call`` style: the forward reads its parameters by name), and
accumulate the grads that come back into ``.grad`` themselves, as eager's
AccumulateGrad would: a copy laid out like the parameter when ``.grad`` is
None, an in-place sum otherwise.

A grad eager leaves None (a leaf no output that needs grad reaches) comes
back from torch.func as zeros: the loss function records which leaves its
graph reaches, and only those get a ``.grad``. A nonzero grad for a leaf it
does not reach is still written, so a wrong value is never hidden as None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from harness.materialize.tensors import Built

Tensors = dict[str, torch.Tensor]


@dataclass
class Leaves:
    """One microbatch's tensors as the transform sees them: ``params`` and
    ``inputs`` are differentiated, ``frozen`` and ``consts`` are not."""

    params: Tensors
    inputs: Tensors
    frozen: Tensors
    consts: Tensors


def leaves(params: dict[str, torch.nn.Parameter], inputs: Tensors) -> Leaves:
    """Detached leaves: the transform, not autograd's graph, owns the differentiation."""
    return Leaves(
        params={n: p.detach() for n, p in params.items() if p.requires_grad},
        inputs={n: x.detach() for n, x in inputs.items() if x.requires_grad},
        frozen={n: p.detach() for n, p in params.items() if not p.requires_grad},
        consts={n: x.detach() for n, x in inputs.items() if not x.requires_grad},
    )


@dataclass
class Reach:
    """The leaves the live outputs' graph reaches, recorded by the loss
    function as it runs inside the transform (the same for every microbatch
    of a case: the graph's structure does not depend on the data)."""

    names: set[str] = field(default_factory=set)

    def record(self, outs: list[torch.Tensor], leaves: Tensors) -> None:
        func_reach(outs, leaves, self.names)


def func_reach(outs, leaves, reached):
    """The leaves the outputs' graph reaches: eager leaves the others' .grad None.
    Plain torch: the standalone script pastes this very function."""
    ids = {id(t): n for n, t in leaves.items()}
    nodes = [o.grad_fn for o in outs if id(o) not in ids and o.grad_fn is not None]
    reached.update(ids[id(o)] for o in outs if id(o) in ids)
    seen = set()
    while nodes:
        node = nodes.pop()
        if node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None and id(var) in ids:
            reached.add(ids[id(var)])
        nodes.extend(nxt for nxt, _ in node.next_functions if nxt is not None)


LossFn = Callable[[Tensors, Tensors, Tensors, list[torch.Tensor]], tuple[torch.Tensor, list[torch.Tensor]]]


def loss_of(built: Built, frozen: Tensors, reach: Reach) -> LossFn:
    """``loss(params, inputs, consts, cots) -> (loss, outputs)``: one
    microbatch's forward over its leaves by name, and ``sum((o * c).sum())``
    over the outputs that need grad, which is what ``backward(outputs,
    cotangents)`` differentiates. The outputs come back as the aux value."""

    def loss(params: Tensors, inputs: Tensors, consts: Tensors,
             cots: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        outs = built.forward({**frozen, **consts, **params, **inputs})
        live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
        reach.record([o for o, _ in live], {**params, **inputs})
        if not live:
            return torch.zeros((), dtype=built.dtype), outs
        return sum(((o * c).sum() for o, c in live[1:]), (live[0][0] * live[0][1]).sum()), outs

    return loss


def outputs_of(built: Built, frozen: Tensors, reach: Reach) -> Callable[[Tensors, Tensors, Tensors], list[torch.Tensor]]:
    """``f(params, inputs, consts) -> outputs``, the function ``vjp`` takes (its reach recorded as in ``loss_of``)."""

    def f(params: Tensors, inputs: Tensors, consts: Tensors) -> list[torch.Tensor]:
        outs = built.forward({**frozen, **consts, **params, **inputs})
        reach.record([o for o in outs if o.requires_grad], {**params, **inputs})
        return outs

    return f


def _arrived(name: str, g: torch.Tensor, reach: Reach) -> bool:
    """Eager gives this leaf a grad: its graph reaches it, or (a wrong value
    must show, not hide as None) torch.func says it is not zero."""
    return name in reach.names or bool(g.ne(0).any())


def accumulate(params: dict[str, torch.nn.Parameter], grads: Tensors, reach: Reach) -> None:
    """Into ``.grad`` as AccumulateGrad does: a copy in the parameter's
    layout when there is none (never the transform's own buffer, which may
    alias a grad output), an in-place sum into the one there is."""
    for n, g in grads.items():
        if not _arrived(n, g, reach):
            continue
        p = params[n]
        if p.grad is None:
            p.grad = torch.empty_like(p, requires_grad=False).copy_(g)
        else:
            p.grad.add_(g)


def input_grads(inputs: Tensors, grads: Tensors, reach: Reach) -> Tensors:
    """A leaf input's ``.grad`` (a fresh leaf each microbatch, so the grad
    itself), and the input grads by name, as the eager path returns them."""
    for n, g in grads.items():
        if _arrived(n, g, reach):
            inputs[n].grad = torch.empty_like(inputs[n], requires_grad=False).copy_(g)
    return {n: x.grad for n, x in inputs.items()}
