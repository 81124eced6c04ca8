"""DTensor canaries (re-exported from the package) and faults for the pool tests.

The faults are grad-layout "implementations" that break the process group
the way real distributed bugs do, when a grad arrives non-contiguous: one
rank issues a collective the others never join (a hang), or one rank dies.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

from harness.paths.dtensor.canaries import *  # noqa: F401,F403
from harness.paths.dtensor.canaries import CANARIES_DTENSOR, partial_to_replicate  # noqa: F401


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


class transposes_replicate_grads:
    """Hands AccumulateGrad each Replicate parameter's grad with transposed
    local strides (same values): the layout check's fault."""

    @staticmethod
    def install(params, mesh=None):
        from torch.distributed.tensor import DTensor, Replicate

        def hook(g):
            if isinstance(g, DTensor) and g.dim() == 2 and all(isinstance(p, Replicate) for p in g.placements):
                local = g.to_local().mT.contiguous().mT
                return DTensor.from_local(local, g.device_mesh, g.placements, run_check=False,
                                          shape=g.shape, stride=g.stride())
            return None

        for p in params.values():
            if p.requires_grad:
                p.register_hook(hook)
