"""Deliberately wrong 2-D references: drop-ins for ``oracles.mesh_fixed`` and
``oracles.mesh_pp_dp_fixed`` (objects with ``Reference(mesh)``) that each
differ from theirs by one injected bug, which the harness must catch: the
family's self-check canaries."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harness.paths.family import Canary
from oracles import mesh_fixed, mesh_pp_dp_fixed


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


class _SkipsDpReduce(mesh_pp_dp_fixed.Reference):
    """Pipeline x data parallel that never averages over "dp": each replica
    keeps the grad of its own share of the grad outputs, as a stage whose
    wrapper stayed in ``no_sync`` for the whole step would."""

    def reduce_grads(self, step_grads: dict[str, torch.Tensor | None], params: dict[str, torch.Tensor]) -> None:
        for n in sorted(step_grads):
            g = step_grads[n]
            if g is None:
                continue
            p = params[n]
            p.grad = g.detach().clone() if p.grad is None else p.grad.add_(g)


class mesh_pp_dp_skips_dp_reduce:
    Reference = _SkipsDpReduce


CANARIES_MESH = {"mesh_skips_tp_reduce": ("harness.paths.mesh.canaries:mesh_skips_tp_reduce", "fsdp_tp"),
                 "mesh_pp_dp_skips_dp_reduce": ("harness.paths.mesh.canaries:mesh_pp_dp_skips_dp_reduce", "pp_dp")}
BASES = {"fsdp_tp": "mesh.fsdp_tp.fixed", "pp_dp": "mesh.pp_dp.fixed"}


def canaries() -> list[Canary]:
    """Each judged against its kind's fixed path (replicas differ and values are wrong)."""
    from harness.paths.mesh.paths import MeshPath, PpDpPath

    def make(name: str, impl: str, kind: str) -> Any:
        return (PpDpPath if kind == "pp_dp" else MeshPath)(f"canary.{name}", kind, impl)

    return [Canary(name, lambda name=name, impl=impl, kind=kind: make(name, impl, kind), BASES[kind],
                   expects=("value", "replica")) for name, (impl, kind) in CANARIES_MESH.items()]
