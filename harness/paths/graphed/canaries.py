"""The graphed family's canaries: the fixed graph wrapper
(``oracles/graphed_fixed.py``) with one of its two guarantees undone, each
judged against ``graphed.fixed`` on real CUDA graphs.

- ``graphed_static_grad_views`` (seed 000): backward hands autograd
  detached views of the graph's static grad buffers instead of owned
  copies, as ``torch.cuda.make_graphed_callables`` does. With ``.grad``
  None, AccumulateGrad adopts the view as ``.grad`` and the next replay
  writes the next microbatch's grad into it before accumulating: ``2*g2``
  instead of ``g1 + g2`` (value); a grad a hook kept changes under the user
  (mutation). The same findings graphed.stock's known bug gives.
- ``graphed_weak_input_surface`` (seed 003): after capture the wrapper
  holds the static input copies its graphs read and write only through
  their raw data pointers, as the graph manager in the seed held its input
  surface. Nothing owns those blocks any more: the caching allocator hands
  them to the next tensors (the wrapper's own output copies, the user's
  grads, the schedule's allocations), the next forward copies the user's
  args over someone else's tensor and the backward replay reads whatever
  lives there now: wrong grads (value), a tensor the user holds changed
  (mutation), or, once ``empty_cache`` gave the segment back to the driver,
  an illegal address (crash: the path runs in a child process).

Real CUDA graphs need CUDA: without it both canaries are unavailable (the
path says "needs CUDA"), which selfcheck reports as skipped with that
reason, never as caught. Like the graphed paths they run in a crash-isolated
child process.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.paths.family import Canary
from harness.paths.graphed import paths as graphed
from harness.workers.isolation import IsolatedPath
from oracles import graphed_fixed

TIMEOUT = 120.0  # seconds per case in the child, CUDA context start included


class StaticGradViews(graphed_fixed.GraphedCallable):
    """Returns the static grad buffers themselves (detached), not copies."""

    def _returned(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.detach()


def _raw_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not own it: a storage built
    from the bare address and size (what a raw-pointer weak reference
    rebuilds), so the caching allocator takes the block back once ``t``
    dies while this alias still points into it."""
    if t.numel() == 0:
        return t  # no memory to lose
    storage = t.untyped_storage()
    raw = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    alias.set_(raw, t.storage_offset(), t.shape, t.stride())
    return alias.requires_grad_(t.requires_grad)


class WeakInputSurface(graphed_fixed.GraphedCallable):
    """Holds its captured input surface (the static copies of the user's
    args) by raw pointer only, from the end of capture on."""

    def _surface_after_capture(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [_raw_alias(t) for t in tensors]

    def finish(self) -> None:
        super().finish()
        # The static outputs' autograd history from capture is never run again
        # (the backward is a replayed graph), but it still reaches the
        # AccumulateGrad node of every static input that requires grad, and
        # that node owns its tensor. Detached, nothing but the raw pointers
        # above refers to the surface: its blocks go back to the allocator now.
        self.static_outputs = [o.detach() if isinstance(o, torch.Tensor) else o for o in self.static_outputs]


def _graph(kind: type, callables: Any, sample_args: Any, num_warmup_iters: int = 3,
           allow_unused_input: bool = False, pool: Any = None, *, backend: Any = None) -> Any:
    """``graphed_fixed.make_graphed_callables`` with ``kind`` for its callables."""
    single = not isinstance(callables, tuple)
    fns = (callables,) if single else callables
    args = (sample_args,) if single else sample_args
    backend = backend if backend is not None else graphed_fixed.CudaGraphs()
    pool = backend.new_pool() if pool is None else pool
    made = [kind(f, a, allow_unused_input, backend) for f, a in zip(fns, args)]
    out = graphed_fixed.capture_all(made, num_warmup_iters, pool, backend)
    return out[0] if single else tuple(out)


def static_grad_views(callables: Any, sample_args: Any, num_warmup_iters: int = 3,
                      allow_unused_input: bool = False, pool: Any = None, *, backend: Any = None) -> Any:
    """The fixed wrapper whose backward returns views of its static grad buffers (seed 000)."""
    return _graph(StaticGradViews, callables, sample_args, num_warmup_iters, allow_unused_input, pool,
                  backend=backend)


def weak_input_surface(callables: Any, sample_args: Any, num_warmup_iters: int = 3,
                       allow_unused_input: bool = False, pool: Any = None, *, backend: Any = None) -> Any:
    """The fixed wrapper holding its input surface by raw pointer (seed 003)."""
    return _graph(WeakInputSurface, callables, sample_args, num_warmup_iters, allow_unused_input, pool,
                  backend=backend)


def canary_path(name: str, impl: str) -> graphed.GraphedPath:
    """``graphed.fixed`` exactly (device, contract, warm-ups, owned outputs), with the canary's wrapper."""
    path = graphed.fixed()
    path.name, path.impl_spec = name, impl
    return path


def _isolated(name: str, impl: str) -> IsolatedPath:
    return IsolatedPath(("harness.paths.graphed.canaries:canary_path", {"name": name, "impl": impl}), timeout=TIMEOUT)


def canaries() -> list[Canary]:
    """Budgets: the grad views show on the first case whose ``.grad`` starts
    None over two microbatches (the 3rd example of seeds 0 and 1 on the CPU
    replay of the same case stream, tests/cover/test_canaries.py). The
    weak surface shows once the allocator hands a freed block on and the
    next forward or replay touches it; it keeps the default budget, and a
    first finding the re-run does not confirm (allocator state differs)
    does not end its run (the self-check stops at a confirmed one)."""
    return [
        Canary("graphed_static_grad_views",
               lambda: _isolated("canary.graphed_static_grad_views", "harness.paths.graphed.canaries:static_grad_views"),
               "graphed.fixed", budget=100, expects=("value", "mutation")),
        Canary("graphed_weak_input_surface",
               lambda: _isolated("canary.graphed_weak_input_surface", "harness.paths.graphed.canaries:weak_input_surface"),
               "graphed.fixed", budget=300, expects=("value", "mutation", "crash")),
    ]
