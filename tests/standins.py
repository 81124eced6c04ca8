"""Graph wrappers for the tests: CPU stand-ins for CI, and canaries.

CI has no GPU, so a CUDA graph cannot be captured there. What matters for
the founding bug is not the kernels but the buffers: a graph replays into
the *same static memory* every time. ``CpuReplay`` keeps exactly that: a
"captured" function is re-run on replay and its results are written into
the static tensors returned at capture. On top of it:

- ``aliased``: stock ``make_graphed_callables`` semantics (seed 000): the
  static input surface is the caller's sample args, forward returns
  detached views of the static outputs and backward detached views of the
  static grad buffers. AccumulateGrad adopts the param one as ``.grad``
  when ``.grad`` is None; the next replay overwrites it: ``g2 + g2``.
- ``fixed``: ``oracles.graphed_fixed`` itself on the CPU backend, so its
  ownership logic is tested by the same checks.
- ``weakref_canary()`` (GPU, seed 003): the self-check's canary
  ``graphed_weak_input_surface`` (harness/paths/graphed/canaries.py), the fixed
  wrapper holding its input surface by raw pointer after capture; the
  caching allocator reuses the memory and replays read and write someone
  else's tensors.
- ``crashes`` / ``hangs``: wrappers that segfault or never return once a
  second microbatch arrives, for the crash-isolation tests.

``paths(options)`` puts them behind the path protocol (``--path tests.standins:paths``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from harness.workers.isolation import IsolatedPath
from harness.paths.graphed.paths import GraphedPath
from oracles import graphed_fixed


class CpuReplay:
    """A "graph" on the CPU: replay re-runs the function into the captured static tensors."""

    def new_pool(self) -> None:
        return None

    def warmup_stream(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        pass

    def capture(self, fn, pool):
        static = fn()

        def replay() -> None:
            fresh = fn()
            with torch.no_grad():
                for s, f in zip(static, fresh):
                    # A result that is a view of a static input (an output that
                    # only reshapes an input) is already in place: a real
                    # graph has no kernel for it either.
                    if s is not None and f is not None and s.data_ptr() != f.data_ptr():
                        s.detach().copy_(f)

        return static, replay


def aliased(module: torch.nn.Module, sample_args: tuple, num_warmup_iters: int = 3,
            allow_unused_input: bool = False, pool: Any = None) -> torch.nn.Module:
    """Stock make_graphed_callables semantics on the CPU: static buffers returned aliased."""
    backend = CpuReplay()
    params = tuple(module.parameters())
    user = list(sample_args)  # the static input surface is the caller's tensors, as in stock
    # A CUDA replay runs no Python, so it cannot fire the user's hooks on the
    # parameters; the CPU re-run differentiates aliases of them instead.
    aliases = {name: p.detach().requires_grad_(p.requires_grad) for name, p in module.named_parameters()}
    surface = user + list(aliases.values())
    state: dict[str, Any] = {}

    def fwd() -> list:
        with torch.enable_grad():
            flat, state["spec"] = tree_flatten(torch.func.functional_call(module, aliases, tuple(user)))
        state["live"] = flat
        return flat

    def bwd() -> list:
        outs = [o for o in state["live"] if o.requires_grad]
        wrt = [s for s in surface if s.requires_grad]
        got = torch.autograd.grad(outs, wrt, [g for g in static_grad_outputs if g is not None],
                                  allow_unused=allow_unused_input)
        it = iter(got)
        return [next(it) if s.requires_grad else None for s in surface]

    static_outputs, replay_fwd = backend.capture(fwd, pool)
    static_grad_outputs = [torch.empty_like(o) if o.requires_grad else None for o in static_outputs]
    static_grad_inputs, replay_bwd = backend.capture(bwd, pool)

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for s, x in zip(user, inputs[: len(user)]):
                if s.data_ptr() != x.data_ptr():
                    s.detach().copy_(x)
            replay_fwd()
            return tuple(o.detach() for o in static_outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            for buf, g in zip(static_grad_outputs, grads):
                if buf is not None and buf.data_ptr() != g.data_ptr():
                    buf.copy_(g)
            replay_bwd()
            return tuple(b.detach() if b is not None else None for b in static_grad_inputs)

    def graphed(*args):
        flat, _ = tree_flatten(tuple(args))
        return tree_unflatten(list(Graphed.apply(*flat, *params)), state["spec"])

    return graphed


def fixed(module, sample_args, num_warmup_iters=3, allow_unused_input=False, pool=None):
    """The real fixed wrapper, on the CPU replay backend."""
    return graphed_fixed.make_graphed_callables(module, sample_args, num_warmup_iters, allow_unused_input, pool,
                                               backend=CpuReplay())


def _after_first(module, on_second) -> torch.nn.Module:
    original = module.forward
    calls = [0]

    def forward(*args):
        calls[0] += 1
        if calls[0] == 2:
            on_second()
        return original(*args)

    module.forward = forward
    return module


def crashes(module, sample_args, num_warmup_iters=3, allow_unused_input=False, pool=None):
    """Segfaults on the second microbatch, as a replay through a dangling pointer can."""
    return _after_first(fixed(module, sample_args, num_warmup_iters, allow_unused_input, pool),
                        lambda: os.kill(os.getpid(), signal.SIGSEGV))


def hangs(module, sample_args, num_warmup_iters=3, allow_unused_input=False, pool=None):
    """Never returns from the second microbatch."""
    return _after_first(fixed(module, sample_args, num_warmup_iters, allow_unused_input, pool),
                        lambda: time.sleep(3600))


def standin(name: str, impl: str, owned_outputs: bool = False, device: str = "cpu") -> GraphedPath:
    return GraphedPath(name, impl, device=device, owned_outputs=owned_outputs)


def weakref_canary() -> IsolatedPath:
    """The seed-003 canary on the GPU, in a worker (it may crash)."""
    from harness.paths.graphed.canaries import canaries

    return next(c for c in canaries() if c.name == "graphed_weak_input_surface").make()


def paths(options: Any = None) -> list:
    """The CPU stand-ins as paths: ``gradfuzz fuzz --path tests.standins:paths``."""
    return [
        standin("standin.aliased", "tests.standins:aliased"),
        standin("standin.fixed", "tests.standins:fixed", owned_outputs=True),
    ]


def isolated(name: str, impl: str, timeout: float = 60.0, owned_outputs: bool = False) -> IsolatedPath:
    return IsolatedPath(("tests.standins:standin", {"name": name, "impl": impl, "owned_outputs": owned_outputs}),
                        timeout=timeout)


class crashes_in_its_own_code:
    """A split 'canary' whose own wrapper code raises on cases with a weight
    group (as the set-indexing canaries did on torch 2.11): what a fuzzer
    finds is the canary crashing, not a gradient bug it injects."""

    @staticmethod
    def stage_backward_input(*args, **kwargs):
        from oracles import split_fixed

        dinputs, groups = split_fixed.stage_backward_input(*args, **kwargs)
        if groups:
            names = {"intermediates"}
            names[0]  # noqa: B018  TypeError: 'set' object is not subscriptable (a literal would warn at compile)
        return dinputs, groups

    @staticmethod
    def stage_backward_weight(weights, param_groups, retain_graph=False):
        from oracles import split_fixed

        return split_fixed.stage_backward_weight(weights, param_groups, retain_graph)


class exits:
    """A split implementation whose process dies on its first backward (a
    case that kills the process it runs in, as a native crash would)."""

    @staticmethod
    def stage_backward_input(*args, **kwargs):
        os._exit(3)

    stage_backward_weight = stage_backward_input
