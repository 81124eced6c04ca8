"""FSDP2 x TP on a ("dp", "tp") mesh, right by construction: the reference the
``mesh.fsdp_tp.fixed`` path holds to the oracle.

What the composition promises a user: after every backward, each parameter's
``.grad`` is the mean over the "dp" groups of the grad each group computed
(a group's grad being the sum of what its "tp" ranks contributed), added to
the ``.grad`` that was there. This reference keeps only that promise with
plain tensors and plain collectives on the mesh's own sub-groups: every rank
holds full parameters; each rank's grad output is its own share (over "tp",
drawn by the rank code) of its dp group's; after every backward each leaf grad is all-reduced (sum)
over "tp", then all-reduced (sum) over "dp" and divided by the dp size, in
one fixed order on every rank, and added into ``.grad``. No FSDP2, no
DTensor, no parallel styles. Input and retained grads are summed over "tp"
the same way (``over_tp``): each dp group's value, whose mean is the grad.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from oracles import dtensor_fixed

# The step: grads of its own for the optimizer, as the other fixed references take it.
optimizer_step = dtensor_fixed.optimizer_step


class Reference:
    def __init__(self, mesh: Any) -> None:
        self.tp_group = mesh.get_group("tp")
        self.dp_group = mesh.get_group("dp")
        self.tp_size = dist.get_world_size(self.tp_group)
        self.dp_size = dist.get_world_size(self.dp_group)

    def over_tp(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """The dp group's value of a grad each tp rank holds a part of (a new tensor)."""
        if t is None:
            return None
        t = t.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.tp_group)
        return t

    def reduce_grads(self, leaves: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> None:
        """Each leaf's grad summed over "tp", averaged over "dp", added into its parameter's ``.grad``."""
        for n in sorted(leaves):  # the same order on every rank; the same leaves have grads on every rank
            g = self.over_tp(leaves[n].grad)
            if g is None:
                continue
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self.dp_group)
            g.div_(self.dp_size)
            p = params[n]
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
