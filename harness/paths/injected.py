"""The founding bug, put back into torch's split backward.

Two families' canaries inject it: split (into ``split.stock``) and pipeline
(into a stage's input/weight split). Written once here, at the core, so
neither family imports the other.
"""

from __future__ import annotations

import torch.distributed.pipelining._backward as stock


class _LooksSingle(list):
    """A list of intermediates whose len() is 1: stock 2.13+ then skips the
    prehook that clamps saved grads, which is the pre-2.13 behaviour."""

    def __len__(self) -> int:
        return 1


class double_count_nested:
    """The founding bug (seed 001): a weight nested on one path (x @ w @ w)
    is counted once per captured intermediate that reaches it."""

    @staticmethod
    def stage_backward_input(*args, **kwargs):
        dinputs, groups = stock.stage_backward_input(*args, **kwargs)
        for g in groups:
            g["intermediates"] = _LooksSingle(g["intermediates"])
        return dinputs, groups

    stage_backward_weight = staticmethod(stock.stage_backward_weight)
