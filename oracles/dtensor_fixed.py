"""Grad-layout handling for DTensor parameters that keeps the placement.

``AccumulateGrad`` wants ``.grad`` laid out like its parameter. When the
incoming grad is not (a transposed grad from a custom backward), stock
autograd re-lays it out with ``new_empty_strided`` + ``copy_``; on DTensor
before torch 2.13 the fresh tensor is Replicate, so ``copy_`` all-reduces a
Partial grad into it: the placement is lost and a collective runs that
nobody asked for (pytorch/pytorch#180486).

Here the grad is re-laid out before it gets there, by a hook on the
parameter: this rank's local shard is made contiguous and re-wrapped with
the *same* placements and the parameter's global strides. Making a local
shard contiguous is the same for every placement (each rank copies its own
values), so nothing is communicated and Partial stays Partial.
``AccumulateGrad`` then sees a grad that already obeys its layout contract
and adopts it as is.

The copy is made every time, not only for a wrong layout: ``AccumulateGrad``
adopts (steals) the incoming buffer as ``.grad``, and when two parameters'
grads are views of one buffer (``stack([w1, w2]).sum(0)``) both adopt the
same storage and the next in-place sum into one writes into the other (a
torch bug of its own, seen on plain tensors by ``eager.accumulate``). A
buffer of our own per grad cannot alias.

Use: ``install(params)`` after creating the parameters (the harness
calls ``install(params, mesh)``), ``optimizer_step(optimizer, params)``
in place of ``optimizer.step()`` and ``clip_grad_norm`` in place of
``torch.nn.utils.clip_grad_norm_``. Parameters are assumed contiguous, as
``nn.Parameter`` makes them; a grad for a non-contiguous parameter is left
alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def keep_layout(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    """``grad`` laid out like ``param``, same placements, in a buffer of its own, no communication."""
    if not isinstance(grad, DTensor) or not param.is_contiguous():
        return None
    local = grad.to_local().clone(memory_format=torch.contiguous_format)
    return DTensor.from_local(
        local, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape, stride=param.stride()
    )


def optimizer_step(optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor]) -> None:
    """``optimizer.step()`` on grads of its own, laid out like the parameters.

    The optimizer gets, for each parameter, a private contiguous copy of its
    grad with the parameter's placements (for a Partial grad that is the
    all-reduce the update needs anyway), and the user's ``.grad`` is put back
    afterwards, untouched. Two torch bugs make this necessary: the CPU fused
    kernels (Adam, AdamW, SGD, Adagrad) read a non-contiguous grad as if it
    were contiguous, and DTensor's redistribution inside the fused op can
    produce one (a Shard(1) grad for a Shard(0) parameter); and
    ``SGD(nesterov=True, foreach=True)`` adds the momentum buffer into
    ``.grad`` in place.
    """
    users: dict[torch.Tensor, torch.Tensor] = {}
    for p in params.values():
        g = p.grad
        if g is None:
            continue
        users[p] = g
        if isinstance(g, DTensor) and isinstance(p, DTensor):
            h = g.redistribute(g.device_mesh, p.placements) if tuple(g.placements) != tuple(p.placements) else g
            local = h.to_local().clone(memory_format=torch.contiguous_format)
            p.grad = DTensor.from_local(local, h.device_mesh, h.placements, run_check=False,
                                        shape=h.shape, stride=p.stride())
        else:
            p.grad = g.detach().clone(memory_format=torch.contiguous_format)
    try:
        optimizer.step()
    finally:
        for p, g in users.items():
            p.grad = g


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0, **kwargs: Any) -> torch.Tensor:
    """``clip_grad_norm_`` that scales each grad with its own ``mul_``.

    Before torch 2.12, DTensor's rule for ``_foreach_mul_`` treats the op as
    non-linear, so a Partial grad is all-reduced into a temporary, the
    temporary is scaled and dropped, and the grad itself stays unclipped
    (the total norm is still right). ``mul_`` by a Replicate scalar is
    linear and keeps Partial, so the per-tensor loop clips correctly on
    every version, with no collective.
    """
    kwargs["foreach"] = False
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, **kwargs)


def install(params: dict[str, torch.Tensor], mesh: Any = None) -> None:
    for p in params.values():
        if isinstance(p, DTensor) and p.requires_grad:
            p.register_hook(lambda g, p=p: keep_layout(p, g))
