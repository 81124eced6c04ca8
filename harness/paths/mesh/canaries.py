"""A deliberately wrong 2-D reference: a drop-in for ``oracles.mesh_fixed``
(an object with ``Reference(mesh)``) that differs from it by one injected
bug, which the harness must catch: the family's self-check canary."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harness.paths.family import Canary
from oracles import mesh_fixed


class _SkipsTp(mesh_fixed.Reference):
    """Averages each parameter grad over "dp" but never sums it over "tp":
    each rank keeps its own tp part, as a composition that reduces over only
    one mesh dim would (input grads are still summed over "tp")."""

    def reduce_grads(self, leaves: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> None:
        for n in sorted(leaves):
            g = leaves[n].grad
            if g is None:
                continue
            g = g.detach().clone()
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self.dp_group)
            g.div_(self.dp_size)
            p = params[n]
            p.grad = g if p.grad is None else p.grad.add_(g)


class mesh_skips_tp_reduce:
    Reference = _SkipsTp
    optimizer_step = staticmethod(mesh_fixed.optimizer_step)


CANARIES_MESH = {"mesh_skips_tp_reduce": "harness.paths.mesh.canaries:mesh_skips_tp_reduce"}


def canaries() -> list[Canary]:
    """Each judged against ``mesh.fsdp_tp.fixed`` (replicas differ and values are wrong)."""
    from harness.paths.mesh.path import MeshPath

    def make(name: str, impl: str) -> Any:
        return MeshPath(f"canary.{name}", "fsdp_tp", impl)

    return [Canary(name, lambda name=name, impl=impl: make(name, impl), "mesh.fsdp_tp.fixed",
                   expects=("value", "replica")) for name, impl in CANARIES_MESH.items()]
