"""Deliberately wrong grad-layout handling for DTensor parameters, and faults.

Each is a drop-in for ``oracles.dtensor_fixed`` (an object with
``install(params, mesh)``), run as ``dtensor.stock`` via ``--dtensor-impl``
or ``DTensorPath(..., impl="tests.canaries_dtensor:NAME")``; the harness
must catch each.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def _relayout_as_replicate(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    """What autograd's layout fix-up did to DTensor before torch 2.13 (the
    seed): a fresh tensor laid out like the parameter, *Replicate*, then
    ``copy_`` of the grad into it, which all-reduces a Partial grad."""
    if not isinstance(grad, DTensor) or grad.stride() == param.stride():
        return None
    local = torch.empty(grad.to_local().shape, dtype=grad.dtype, device=grad.device)
    fresh = DTensor.from_local(local, grad.device_mesh, [Replicate()] * grad.device_mesh.ndim,
                               run_check=False, shape=grad.shape, stride=param.stride())
    return fresh.copy_(grad)


class partial_to_replicate:
    """The founding bug (seed 002): a non-contiguous Partial grad becomes
    Replicate through an all-reduce in the layout fix-up; values stay right."""

    @staticmethod
    def install(params, mesh=None):
        for p in params.values():
            if isinstance(p, DTensor) and p.requires_grad:
                p.register_hook(lambda g, p=p: _relayout_as_replicate(p, g))


def _transposed(g: torch.Tensor) -> bool:
    return g.dim() >= 2 and not g.is_contiguous()


class mismatched_collective:
    """Rank 0 alone all-reduces when a grad arrives non-contiguous: a hang."""

    @staticmethod
    def install(params, mesh=None):
        def hook(g):
            if _transposed(g) and dist.get_rank() == 0:
                dist.all_reduce(torch.zeros(1, device=g.device))
            return None

        for p in params.values():
            if p.requires_grad:
                p.register_hook(hook)


class kills_rank1:
    """Rank 1 dies (SIGKILL) when a grad arrives non-contiguous: a crash."""

    @staticmethod
    def install(params, mesh=None):
        def hook(g):
            if _transposed(g) and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return None

        for p in params.values():
            if p.requires_grad:
                p.register_hook(hook)


CANARIES_DTENSOR = {
    "partial_to_replicate": "tests.canaries_dtensor:partial_to_replicate",
}
