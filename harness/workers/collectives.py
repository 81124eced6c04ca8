"""Counting the collectives a piece of DTensor code issues.

This is the technique of torch's ``CommDebugMode``: a dispatch mode that
steps aside for DTensor (returning ``NotImplemented`` lets DTensor desugar an
op into local ops and collectives) and counts the collectives that come back
through it. It is written out here because ``CommDebugMode`` needs NumPy
(its package imports a visualizer) and tracks modules and every op, which
costs more than the counting we need on every backward.

A counter is cumulative; ``total`` read at two moments gives what ran in
between, which is how the DTensor path attributes collectives to one
parameter's ``AccumulateGrad``.
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# Operator namespaces that hold collectives (functional, legacy functional,
# c10d's own ops, DTensor's fused all-to-all).
_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor"})
# Ops in those namespaces that move no data between ranks.
_NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd", "wait"})


def is_collective(func) -> bool:
    if getattr(func, "namespace", None) not in _NAMESPACES:
        return False
    name = func._overloadpacket.__name__
    return name not in _NOT_COLLECTIVES and not name.startswith("wait")


class CollectiveCounter(TorchDispatchMode):
    """``with counter:`` counts collectives by op name (``all_reduce``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.total = 0
        from torch.distributed.tensor import DTensor

        self._dtensor = DTensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if is_collective(func):
            self.counts[func._overloadpacket.__name__] += 1
            self.total += 1
        return out

    def since(self, mark: Counter[str]) -> dict[str, int]:
        """Collectives counted after ``mark`` (a copy of ``counts`` taken earlier)."""
        return {k: v - mark.get(k, 0) for k, v in self.counts.items() if v - mark.get(k, 0)}
