"""A split backward (dI then dW) that counts every use site exactly once.

Drop-in for ``torch.distributed.pipelining._backward``'s
``stage_backward_input`` / ``stage_backward_weight`` (same signatures).

Why it is shaped like this: the stock functions capture grads at the nodes
where weight paths meet the input path, then restart autograd from those
nodes. Every way that restart goes wrong (a nested site reached from two
captured nodes counted twice, a hook on a captured node applied twice, a
weight whose path never meets an input dropped, a stage output that is a
view refusing ``detach_``) comes from the restart itself. Here the weight
pass is a second, ordinary backward from the stage outputs with the saved
grad outputs, restricted to the weights, so each use site is visited once
by construction. The price is recomputing the input-side part of the
backward in the weight pass; the activations are kept until then, which a
zero-bubble schedule does anyway.

Accumulation into ``.grad`` never adopts a tensor autograd returned: such a
tensor can be the caller's own grad output passed through an identity-like
op, and a later in-place ``+=`` would then write into the caller's buffer.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


def _accumulate(t: torch.Tensor, g: torch.Tensor) -> None:
    """Stands in for AccumulateGrad, so it also runs the leaf's post-accumulate-grad
    hooks once ``.grad`` holds the sum (optimizer-in-backward steps in them)."""
    if t.grad is None:
        t.grad = g.detach().clone(memory_format=torch.contiguous_format)
    else:
        t.grad += g
    for hook in (t._post_accumulate_grad_hooks or {}).values():
        hook(t)


def stage_backward_input(
    stage_outputs_or_loss: list[torch.Tensor],
    output_grads: list[torch.Tensor] | None,
    input_values: list[Any],
    weights: Iterable[torch.nn.Parameter],
) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]]]:
    outputs, grads = [], []
    for i, out in enumerate(stage_outputs_or_loss):
        if out.requires_grad:
            outputs.append(out)
            grads.append(torch.ones_like(out) if output_grads is None else output_grads[i])
    wanted = [i for i, x in enumerate(input_values) if isinstance(x, torch.Tensor) and x.requires_grad]
    dinputs: list[torch.Tensor | None] = [None] * len(input_values)
    if outputs and wanted:
        got = torch.autograd.grad(
            outputs, [input_values[i] for i in wanted], grads, retain_graph=True, allow_unused=True
        )
        for i, g in zip(wanted, got):
            dinputs[i] = g
            if g is not None:
                _accumulate(input_values[i], g)
    return tuple(dinputs), [{"outputs": outputs, "grads": grads}]


def stage_backward_weight(
    weights: Iterable[torch.nn.Parameter],
    param_groups: list[dict[str, Any]],
    retain_graph: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    weights = list(weights)
    before = tuple(w.grad for w in weights)
    wanted = [w for w in weights if w.requires_grad]
    for group in param_groups:
        outputs, grads = group.pop("outputs"), group.pop("grads")
        if not outputs or not wanted:
            continue
        got = torch.autograd.grad(outputs, wanted, grads, retain_graph=retain_graph, allow_unused=True)
        for w, g in zip(wanted, got):
            if g is not None:
                _accumulate(w, g)
    return before
