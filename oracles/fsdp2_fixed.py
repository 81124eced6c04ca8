"""A fully sharded wrapper that is right by construction: the reference the
``fsdp2.fixed`` path holds to the oracle.

What FSDP2 promises a user: every parameter is a ``Shard(0)`` DTensor whose
local piece is ``torch.chunk``'s piece of dim 0 for this rank (empty past
the end: uneven dims give the last ranks less or nothing), and after the
backward that ends an accumulation window its ``.grad`` is the same kind of
DTensor holding this rank's piece of the mean over ranks of the full grads
accumulated in the window, added to the ``.grad`` that was there.

This wrapper does only that, explicitly: before each forward it all-gathers
every parameter into a full tensor (padding dim 0 to a multiple of the world
size, then cutting the padding off again), runs the module's forward on
fresh leaves made from those, sums each leaf's grad into a full-size
accumulator after every backward, and at the end of a synchronising backward
all-reduces each accumulator once (padded as before), divides by the world
size, cuts out this rank's piece and adds it into the sharded ``.grad``. A
tied parameter is one leaf, so its use sites are summed by autograd once.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from harness.materialize.names import case_name
from oracles.dtensor_fixed import optimizer_step  # noqa: F401  (the step: grads of its own for the optimizer)


def _rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of this rank's rows under torch.chunk: chunks of ceil(n/world), none past the end."""
    size = -(-n // world)
    return min(rank * size, n), min((rank + 1) * size, n)


def _padded_rows(n: int, world: int) -> int:
    return -(-n // world) * world


class FixedFSDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, group: Any, mesh: Any) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.mesh = mesh
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.sync = True
        self.reduced: Counter[str] = Counter()
        self.full_shapes: dict[str, torch.Size] = {}
        self.acc: dict[str, torch.Tensor | None] = {}
        self.leaves: dict[str, torch.Tensor] = {}
        for owner_name, owner in list(module.named_modules()):
            for name, p in list(owner.named_parameters(recurse=False)):
                full = p.detach()
                a, b = _rows(full.shape[0], self.world, self.rank)
                local = full[a:b].clone()
                sharded = torch.nn.Parameter(
                    DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()),
                    requires_grad=p.requires_grad)
                owner._parameters[name] = sharded
                self.full_shapes[case_name(name)] = full.shape
                self.acc[case_name(name)] = None

    def set_requires_gradient_sync(self, sync: bool) -> None:
        self.sync = sync

    def set_reshard_after_backward(self, reshard: bool) -> None:
        """Nothing to keep: this wrapper gathers before every forward."""

    def _sharded(self) -> dict[str, torch.nn.Parameter]:
        return {case_name(n): p for n, p in self.module.named_parameters()}

    def _gather(self, p: torch.Tensor, name: str) -> torch.Tensor:
        n = self.full_shapes[name][0]
        local = p.to_local().detach()
        rows = _padded_rows(n, self.world) // self.world
        pad = torch.zeros((rows,) + tuple(local.shape[1:]), dtype=local.dtype, device=local.device)
        pad[: local.shape[0]] = local
        pieces = [torch.empty_like(pad) for _ in range(self.world)]
        dist.all_gather(pieces, pad, group=self.group)  # gloo and nccl both have it
        return torch.cat(pieces)[:n].clone()

    def forward(self, *args: Any) -> Any:
        sharded = self._sharded()
        self.leaves = {n: self._gather(p, n).requires_grad_(p.requires_grad) for n, p in sharded.items()}
        outs = self.module(*args, weights=self.leaves)
        if torch.is_grad_enabled():
            queued = [False]

            def hook(g: torch.Tensor) -> torch.Tensor:
                if not queued[0]:
                    queued[0] = True
                    torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
                return g

            for o in outs:
                if isinstance(o, torch.Tensor) and o.requires_grad:
                    o.register_hook(hook)
        return outs

    def _after_backward(self) -> None:
        for n, leaf in self.leaves.items():
            if leaf.grad is not None:
                self.acc[n] = leaf.grad.clone() if self.acc[n] is None else self.acc[n] + leaf.grad
        if self.sync:
            self.reduce()

    def piece_rows(self, n: int) -> tuple[int, int]:
        return _rows(n, self.world, self.rank)

    def reduce(self) -> None:
        sharded = self._sharded()
        for n in sorted(self.acc):  # the same order on every rank
            full = self.acc[n]
            if full is None:
                continue
            self.acc[n] = None
            rows = _padded_rows(full.shape[0], self.world)
            padded = torch.zeros((rows,) + tuple(full.shape[1:]), dtype=full.dtype, device=full.device)
            padded[: full.shape[0]] = full
            dist.all_reduce(padded, op=dist.ReduceOp.SUM, group=self.group)
            padded.div_(self.world)
            a, b = self.piece_rows(full.shape[0])
            piece = padded[a:b].clone()
            self.reduced[n] += 1
            p = sharded[n]
            if p.grad is None:
                p.grad = DTensor.from_local(piece, self.mesh, [Shard(0)], run_check=False,
                                            shape=p.shape, stride=p.stride())
            else:
                p.grad.to_local().add_(piece)


def wrap(module: torch.nn.Module, group: Any, mesh: Any, options: frozenset[str]) -> FixedFSDP:
    """The rank code's hook: FSDP2's switches (resharding, units) change
    memory and communication, never the grads, so they are ignored here."""
    return FixedFSDP(module, group, mesh)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0, **kwargs: Any) -> torch.Tensor:
    """``clip_grad_norm_`` over sharded grads, from local pieces: an uneven
    dim leaves some ranks an empty piece, whose infinity norm torch refuses
    to compute (no identity for max), so each rank reduces what it has (0
    for nothing) and one all-reduce combines them."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    pieces = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    like = pieces[0]
    group = grads[0].device_mesh.get_group() if isinstance(grads[0], DTensor) else None
    if norm_type == float("inf"):
        local = torch.stack([x.abs().max() if x.numel() else torch.zeros((), dtype=x.dtype, device=x.device)
                             for x in pieces]).max()
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = local
    else:
        local = torch.stack([x.abs().pow(norm_type).sum() for x in pieces]).sum()
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        total = local.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).to(like.dtype)
    for x in pieces:
        x.mul_(coef)
    return total
