"""A data-parallel wrapper that is right by construction: the reference the
``ddp.fixed`` path holds to the oracle.

DDP promises that after the backward that ends an accumulation window every
rank's ``.grad`` is the mean over ranks of what each rank accumulated in the
window (``no_sync`` backwards accumulate locally and reduce nothing). This
wrapper keeps only that promise: no buckets, no views into buckets, no
readiness tracking. At the end of a synchronising backward (a callback the
autograd engine runs once the graph is done) each trainable parameter's
``.grad`` is all-reduced once, in place, and divided by the world size. A
tied parameter is one tensor with one ``.grad``, so it is reduced once
however many use sites it has.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Iterator

import torch
import torch.distributed as dist

from harness.materialize.names import case_name
from oracles.dtensor_fixed import optimizer_step  # noqa: F401  (the step: grads of its own for the optimizer)


class FixedDDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, group: Any) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.world = dist.get_world_size(group)
        self.sync = True
        self.reduced: Counter[str] = Counter()  # all-reduces per parameter, cumulative

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        before, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = before

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        outs = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            queued, sync = [False], self.sync

            def hook(g: torch.Tensor) -> torch.Tensor:
                if not queued[0]:  # once per backward, whichever output's grad comes first
                    queued[0] = True
                    torch.autograd.Variable._execution_engine.queue_callback(
                        lambda: self.after_backward(sync))
                return g

            for o in outs:
                if isinstance(o, torch.Tensor) and o.requires_grad:
                    o.register_hook(hook)
        return outs

    def after_backward(self, sync: bool) -> None:
        # AccumulateGrad may have adopted a view of a buffer another
        # parameter's .grad also views (pytorch#34082); the next backward's
        # in-place sum would then write through into that other .grad. Each
        # .grad gets storage of its own first, then the window may reduce.
        params = [p for p in self.module.parameters() if p.grad is not None]
        ptrs = [p.grad.untyped_storage().data_ptr() for p in params]
        for p, ptr in zip(params, ptrs):
            g = p.grad
            shared = ptrs.count(ptr) > 1 or g.untyped_storage().nbytes() != g.numel() * g.element_size()
            if shared or not g.is_contiguous():
                p.grad = g.clone(memory_format=torch.contiguous_format) if p.is_contiguous() else g.clone()
        if sync:
            self.reduce()

    def reduce(self) -> None:
        # Every rank ran the same graph, so the same parameters have a .grad
        # on every rank and the all-reduces pair up in this fixed order.
        for name, p in self.module.named_parameters():
            if p.requires_grad and p.grad is not None:
                self.reduce_one(case_name(name), p.grad)  # "blocks.0.p_w1" -> "w1"

    def reduce_one(self, name: str, grad: torch.Tensor) -> None:
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group)
        grad.div_(self.world)
        self.reduced[name] += 1


def wrap(module: torch.nn.Module, group: Any, mesh: Any, options: frozenset[str]) -> FixedDDP:
    """The rank code's hook (``harness.paths.parallel.rank``): DDP's switches
    change nothing a correct DDP computes, so they are ignored here."""
    return FixedDDP(module, group)
