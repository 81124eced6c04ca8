"""Deliberately wrong grad-layout handling for DTensor parameters.

A drop-in for ``oracles.dtensor_fixed`` (an object with ``install(params,
mesh)``), run through ``--dtensor-impl harness.paths.dtensor.canaries:NAME`` or
``harness.paths.dtensor.canaries.canaries()``; the harness must catch it. It ships
with the package so ``gradfuzz selfcheck`` can prove detection on the
user's installation.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from harness.paths.family import Canary
from oracles import dtensor_fixed


def _relayout_as_replicate(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    """What autograd's layout fix-up did to DTensor before torch 2.13 (the
    seed): a fresh tensor laid out like the parameter, *Replicate*, then
    ``copy_`` of the grad into it, which all-reduces a Partial grad."""
    if not isinstance(grad, DTensor) or grad.stride() == param.stride():
        return None
    if not all(p.is_partial() for p in grad.placements):
        return None  # the seed's bug is about Partial grads
    local = torch.empty(grad.to_local().shape, dtype=grad.dtype, device=grad.device)
    fresh = DTensor.from_local(local, grad.device_mesh, [Replicate()] * grad.device_mesh.ndim,
                               run_check=False, shape=grad.shape, stride=param.stride())
    return fresh.copy_(grad)


class partial_to_replicate:
    """The founding bug (seed 002): a non-contiguous Partial grad becomes
    Replicate through an all-reduce in the layout fix-up; values stay right.
    Every other grad gets ``oracles.dtensor_fixed``'s handling, so this
    differs from ``dtensor.fixed`` (its base) by the injected bug alone."""

    @staticmethod
    def install(params, mesh=None):
        for p in params.values():
            if isinstance(p, DTensor) and p.requires_grad:
                p.register_hook(lambda g, p=p: _wrong_then_fixed(p, g))

    optimizer_step = staticmethod(dtensor_fixed.optimizer_step)


def _wrong_then_fixed(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    wrong = _relayout_as_replicate(param, grad)
    return wrong if wrong is not None else dtensor_fixed.keep_layout(param, grad)


CANARIES_DTENSOR = {
    "partial_to_replicate": "harness.paths.dtensor.canaries:partial_to_replicate",
}


def canaries() -> list[Canary]:
    """The seed's wrong layout fix-up, judged against ``dtensor.fixed``."""
    from harness.paths.dtensor.paths import DTensorPath

    return [
        Canary(f"dtensor_{name}", lambda name=name, impl=impl: DTensorPath(f"canary.dtensor_{name}", impl),
               "dtensor.fixed", expects=("placement", "collective"))
        for name, impl in CANARIES_DTENSOR.items()
    ]
