"""Deliberately wrong data-parallel wrappers: drop-ins for ``oracles.ddp_fixed``
and ``oracles.fsdp2_fixed`` (objects with ``wrap(module, group, mesh,
options)``), each differing from its base by one injected bug that the
harness must catch from a cold start."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harness.paths.family import Canary
from oracles import ddp_fixed, fsdp2_fixed


def _tied(module: torch.nn.Module) -> set[str]:
    """Parameters with two or more use sites in the case (a tied weight)."""
    case = module.built.case
    uses = [u.ref for n in case.nodes for u in n.args] + [u.ref for u in case.outputs]
    return {p.name for p in case.params if uses.count(p.name) > 1}


class _DoubleReduceDDP(ddp_fixed.FixedDDP):
    """A tied parameter spanning two buckets is all-reduced once per bucket,
    and divided by the world size once: its grad comes out world-size times too large."""

    def reduce_one(self, name: str, grad: torch.Tensor) -> None:
        if name in _tied(self.module):
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group)
            self.reduced[name] += 1
        super().reduce_one(name, grad)


class ddp_reduces_tied_twice:
    optimizer_step = staticmethod(ddp_fixed.optimizer_step)

    @staticmethod
    def wrap(module: torch.nn.Module, group: Any, mesh: Any, options: frozenset[str]) -> _DoubleReduceDDP:
        return _DoubleReduceDDP(module, group)


class _DropsPaddingFSDP(fsdp2_fixed.FixedFSDP):
    def piece_rows(self, n: int) -> tuple[int, int]:
        """Un-padding that keeps a short last piece's padding and drops its
        data: the piece is taken from the end of its padded chunk."""
        a, b = super().piece_rows(n)
        size = -(-n // self.world)
        if 0 < b - a < size:
            return a + size - (b - a), a + size
        return a, b


class fsdp2_drops_last_shard_padding:
    optimizer_step = staticmethod(fsdp2_fixed.optimizer_step)
    clip_grad_norm = staticmethod(fsdp2_fixed.clip_grad_norm)

    @staticmethod
    def wrap(module: torch.nn.Module, group: Any, mesh: Any, options: frozenset[str]) -> _DropsPaddingFSDP:
        return _DropsPaddingFSDP(module, group, mesh)


CANARIES_PARALLEL = {
    "ddp_reduces_tied_twice": ("ddp", "harness.paths.parallel.canaries:ddp_reduces_tied_twice"),
    "fsdp2_drops_last_shard_padding": ("fsdp2", "harness.paths.parallel.canaries:fsdp2_drops_last_shard_padding"),
}


def canaries() -> list[Canary]:
    """Each judged against its fixed base, on the pool's default world size (2)."""
    from harness.paths.parallel.paths import DataParallelPath

    return [
        Canary(name, lambda name=name, kind=kind, impl=impl: DataParallelPath(f"canary.{name}", kind, impl),
               f"{kind}.fixed", expects=("value", "collective") if kind == "ddp" else ("value",))
        for name, (kind, impl) in CANARIES_PARALLEL.items()
    ]
