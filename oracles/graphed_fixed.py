"""A graph wrapper that hands autograd only what autograd may keep.

Drop-in for ``torch.cuda.make_graphed_callables`` (same arguments, plus a
``backend`` seam), fixing the two founding bug classes of graph wrappers:

- Backward returns *clones* of the static grad buffers. The stock wrapper
  returns detached aliases; when ``param.grad`` is None, AccumulateGrad
  adopts the alias as ``.grad`` and the next replay writes the next
  microbatch's grad into it before accumulating: ``g2 + g2`` instead of
  ``g1 + g2`` (seed 000). The same goes for input grads and for any grad a
  hook keeps. Forward returns clones of the static outputs too, so an
  earlier microbatch's output survives the next replay.
- The input surface (static copies of the user's args, and the module's
  parameters) is owned here and held strongly for the wrapper's lifetime:
  the graphs have its addresses baked in. A wrapper that holds it through
  raw-pointer weak references reads freed memory once the caching
  allocator reuses or releases it (seed 003). A parameter whose storage
  moved after capture is an error here, not a silent read of the old one.

The price is one device copy per output and per grad per call.

``backend`` says how a function is captured and replayed: CUDA graphs by
default. The tests supply a CPU stand-in that re-runs the captured function
and writes the results into the same static buffers, so the ownership
logic in this file runs in CI without a GPU.

Each guarantee sits behind one method (``_returned`` for the grads,
``_surface_after_capture`` for the input surface), so the self-check's
graphed canaries (harness/paths/graphed/canaries.py) can undo exactly one.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

Replay = Callable[[], None]


class CudaGraphs:
    """Capture with ``torch.cuda.CUDAGraph``; replay re-launches the kernels."""

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def warmup_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(torch.cuda.Stream())

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def capture(self, fn: Callable[[], list], pool: Any) -> tuple[list, Replay]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            static = fn()
        return static, graph.replay


class GraphedCallable:
    """One callable's forward and backward graphs and their static buffers."""

    def __init__(self, fn: Any, sample_args: Sequence[Any], allow_unused_input: bool, backend: Any) -> None:
        self.module = fn if isinstance(fn, torch.nn.Module) else None
        self.call = fn.forward if self.module is not None else fn  # the original, before install()
        self.params: tuple[torch.nn.Parameter, ...] = tuple(fn.parameters()) if self.module is not None else ()
        flat, self.arg_spec = tree_flatten(tuple(sample_args))
        if not all(isinstance(x, torch.Tensor) for x in flat):
            raise TypeError("graphed callable: sample_args must contain only tensors")
        # Owned copies: the caller may reuse or free its sample args at will.
        self.static_inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in flat]
        self.allow_unused = allow_unused_input
        self.backend = backend
        self.training = self.module.training if self.module is not None else None
        # The graphs differentiate aliases of the parameters (same storage), so
        # hooks the user put on the parameters themselves see only the grads
        # this wrapper returns, never warm-up, capture or replay internals.
        self.proxies = {id(p): p.detach().requires_grad_(p.requires_grad) for p in self.params}
        self._live: list | None = None  # outputs of the forward whose graph the backward differentiates

    def surface(self) -> list[torch.Tensor]:
        return [*self.static_inputs, *(self.proxies[id(p)] for p in self.params)]

    @contextlib.contextmanager
    def _proxied(self):
        """The module's parameters swapped for their aliases while the original forward runs."""
        swapped = []
        if self.module is not None:
            for mod in self.module.modules():
                for name, p in list(mod._parameters.items()):
                    if p is not None and id(p) in self.proxies:
                        mod._parameters[name] = self.proxies[id(p)]
                        swapped.append((mod, name, p))
        try:
            yield
        finally:
            for mod, name, p in swapped:
                mod._parameters[name] = p

    def _forward(self) -> list:
        with torch.enable_grad(), self._proxied():
            out = self.call(*tree_unflatten(self.static_inputs, self.arg_spec))
        flat, self.out_spec = tree_flatten(out)
        self._live = flat
        return flat

    def _backward(self) -> list:
        assert self._live is not None, "backward graph captured or replayed before any forward"
        outs = [o for o in self._live if isinstance(o, torch.Tensor) and o.requires_grad]
        grad_outs = [g for g in self.static_grad_outputs if g is not None]
        surface = self.surface()
        wrt = [s for s in surface if s.requires_grad]
        got: Sequence[torch.Tensor | None] = [None] * len(wrt)
        if outs and wrt:
            got = torch.autograd.grad(outs, wrt, grad_outs, allow_unused=self.allow_unused)
        it = iter(got)
        return [next(it) if s.requires_grad else None for s in surface]

    def warmup(self, iters: int) -> None:
        for _ in range(iters):
            outs = [o for o in self._forward() if isinstance(o, torch.Tensor) and o.requires_grad]
            wrt = [s for s in self.surface() if s.requires_grad]
            if outs and wrt:
                torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=self.allow_unused)
        self._live = None

    def capture_forward(self, pool: Any) -> None:
        self.static_outputs, self.replay_forward = self.backend.capture(self._forward, pool)
        self.static_grad_outputs = [
            torch.empty_like(o) if isinstance(o, torch.Tensor) and o.requires_grad else None for o in self.static_outputs
        ]

    def capture_backward(self, pool: Any) -> None:
        self.static_grad_inputs, self.replay_backward = self.backend.capture(self._backward, pool)

    def finish(self) -> None:
        if isinstance(self.backend, CudaGraphs):
            self._live = None  # the graphs replay without it; a re-running backend needs it
        self.static_inputs = self._surface_after_capture(self.static_inputs)
        self.param_ptrs = [p.data_ptr() for p in self.params]

    def _surface_after_capture(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """How the captured input surface is held from now on: strongly, by these very tensors."""
        return tensors

    def _returned(self, buf: torch.Tensor) -> torch.Tensor:
        """What backward hands autograd for a static grad buffer: an owned copy,
        since AccumulateGrad may adopt it as ``.grad`` and hooks may keep it."""
        return buf.detach().clone()

    def _check_params(self) -> None:
        for i, (p, ptr) in enumerate(zip(self.params, self.param_ptrs)):
            if p.data_ptr() != ptr:
                raise RuntimeError(
                    f"graphed callable: parameter {i} {tuple(p.shape)} was re-allocated after capture; "
                    "the captured graphs still read its old storage (re-graph the callable)"
                )

    def install(self) -> Any:
        me = self
        n_user = len(self.static_inputs)
        # Parameters that got no grad at capture (unused, with allow_unused_input)
        # stay out of the Function's inputs: an input whose grad comes back None
        # still runs its AccumulateGrad, which fires the parameter's hooks with
        # None and its post-accumulate hooks, where eager never touches it.
        used = [i for i, g in enumerate(self.static_grad_inputs[n_user:]) if g is not None]
        wired = [self.params[i] for i in used]

        class Graphed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs: torch.Tensor):  # type: ignore[override]
                me._check_params()
                for s, x in zip(me.static_inputs, inputs[:n_user]):
                    if s is not x:
                        s.detach().copy_(x)
                me.replay_forward()
                outs = tuple(o.detach().clone() for o in me.static_outputs)
                ctx.mark_non_differentiable(*[o for o, g in zip(outs, me.static_grad_outputs) if g is None])
                return outs

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
                for buf, g in zip(me.static_grad_outputs, grads):
                    if buf is not None:
                        if g is None:
                            buf.zero_()
                        else:
                            buf.copy_(g)
                me.replay_backward()
                grads = list(me.static_grad_inputs[:n_user]) + [me.static_grad_inputs[n_user + i] for i in used]
                return tuple(None if b is None else me._returned(b) for b in grads)

        def graphed(*user_args: Any) -> Any:
            flat, _ = tree_flatten(tuple(user_args))
            out = Graphed.apply(*flat, *wired)
            return tree_unflatten(list(out), me.out_spec)

        if self.module is None:
            return graphed
        module, original = self.module, self.call

        def forward(*args: Any, **kwargs: Any) -> Any:
            if module.training == me.training and not kwargs:
                return graphed(*args)
            return original(*args, **kwargs)

        module.forward = forward
        return module


def make_graphed_callables(
    callables: Any,
    sample_args: Any,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any = None,
    *,
    backend: Any = None,
) -> Any:
    """Graph each callable (a module or a function) with owned inputs and grads.

    Several callables share one pool; as with the stock function, capture
    order is all forwards, then all backwards in reverse, which is the order
    they must run in.
    """
    single = not isinstance(callables, tuple)
    fns = (callables,) if single else callables
    args = (sample_args,) if single else sample_args
    backend = backend if backend is not None else CudaGraphs()
    pool = backend.new_pool() if pool is None else pool
    made = [GraphedCallable(f, a, allow_unused_input, backend) for f, a in zip(fns, args)]
    out = capture_all(made, num_warmup_iters, pool, backend)
    return out[0] if single else tuple(out)


def capture_all(made: list[GraphedCallable], num_warmup_iters: int, pool: Any, backend: Any) -> list:
    """Warm up, capture (forwards in order, backwards in reverse) and install each callable."""
    backend.synchronize()
    with backend.warmup_stream():
        for m in made:
            m.warmup(num_warmup_iters)
    backend.synchronize()
    for m in made:
        m.capture_forward(pool)
    for m in reversed(made):
        m.capture_backward(pool)
    for m in made:
        m.finish()
    return [m.install() for m in made]
