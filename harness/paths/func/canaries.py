"""Canaries: func paths broken the way a torch.func training loop goes wrong.

- ``func_drops_microbatch``: ``func.grad`` whose loop never accumulates the
  second microbatch of each step (an off-by-one over the microbatches);
- ``func_vmap_shares_cotangent``: ``func.vmap`` with every microbatch fed
  the first microbatch's grad outputs (the cotangents' batch dim lost: a
  wrong ``in_dims`` or an ``expand`` where a stack was meant).

Each is judged against its own good path, so what is caught is the injected
bug, not one the transform itself may have.
"""

from __future__ import annotations

import torch

from harness.paths.family import Canary
from harness.paths.func.paths import Bug, FuncPath, Tensors


def _drop_second(j: int, grads: Tensors) -> Tensors:
    return {} if j == 1 else grads


def _first_for_all(cots: list[torch.Tensor]) -> list[torch.Tensor]:
    return [c[:1].expand_as(c) for c in cots]


def canaries() -> list[Canary]:
    return [
        Canary("func_drops_microbatch",
               lambda: FuncPath("grad", "canary.func_drops_microbatch", Bug(grads=_drop_second)), "func.grad"),
        Canary("func_vmap_shares_cotangent",
               lambda: FuncPath("vmap", "canary.func_vmap_shares_cotangent", Bug(stacked=_first_for_all)),
               "func.vmap"),
    ]
