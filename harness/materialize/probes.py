"""Fix probes: the smallest in-process change that removes exactly one known bug.

Most ledger bugs have no outside workaround (nothing a user can do short of
upgrading torch), so the gate could only call them known by their signature,
and a second bug of the same shape would pass as the first. A fix probe
gives such an entry a causal check all the same: the gate runs the case
again with the probe in force, and the row is the bug only when the probe
removes the finding at its place and nothing else changes.

A probe is never advice to a user: it patches torch inside the harness's own
process (the upstream fix applied at run time, or a patched copy of the one
torch function at fault), so reports say "fix probe" apart from "workaround".
Each probe patches one function (with every alias other torch modules
imported by name) and restores it on exit. It is written as a textual edit
of the installed torch's own source: the probe changes exactly the lines that
hold the bug and keeps whatever else this torch version does, and on a torch
whose source no longer holds those lines it refuses to run (``Unavailable``)
instead of testing something else.

The gate reaches a probe through ``harness.materialize.workarounds.in_force``
exactly as it reaches a workaround: in this process, and in the worker and
rank processes whose messages carry ``in_force_now()``.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
import textwrap
import threading
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, ContextManager, Iterator

KIND = "fix probe"


class Unavailable(RuntimeError):
    """The probe cannot be applied to the torch installed here (its lines are not there)."""


@dataclass(frozen=True)
class Edit:
    """``old`` -> ``new`` in the source of ``module.function`` (``old`` must occur exactly once)."""

    module: str
    function: str  # a module-level function, or ``Class.method``
    changes: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Probe:
    name: str
    effect: str  # one sentence: what the probe changes, shown in reports beside "known"
    edits: tuple[Edit, ...] = ()
    # A probe that is not a source edit: a function returning a context manager.
    custom: Callable[[], ContextManager[None]] | None = None
    # The same fix written against an older release's source, where the lines
    # ``edits`` change were written otherwise: a gate upgrading from that
    # release checks its rows causally too.
    older: tuple[Edit, ...] = ()

    def patch(self) -> ContextManager[None]:
        return self.custom() if self.custom is not None else _edits_in_force(self.applicable())

    def applicable(self) -> tuple[Edit, ...]:
        """The edit set this torch's source holds: ``edits``, else ``older``
        (Unavailable, with the newer set's reason, where neither does).
        Decided once per process, against torch as shipped: under another
        probe in force the function to read may be that probe's copy."""
        with _LOCK:
            if self not in _CHOSEN:
                _CHOSEN[self] = self._choose()
        chosen = _CHOSEN[self]
        if isinstance(chosen, Unavailable):
            raise chosen
        return chosen

    def _choose(self) -> tuple[Edit, ...] | Unavailable:
        first: Unavailable | None = None
        for edits in (self.edits, self.older) if self.older else (self.edits,):
            try:
                for edit in edits:
                    _rewritten(edit)
                return edits
            except (Unavailable, AttributeError, ImportError, OSError, TypeError) as e:
                first = first or (e if isinstance(e, Unavailable) else Unavailable(f"{type(e).__name__}: {e}"))
        assert first is not None
        return first

    def functions(self) -> set[tuple[str, str]]:
        """The torch functions this probe rewrites (none known for a custom one)."""
        try:
            return {(e.module, e.function) for e in self.applicable()}
        except Unavailable:
            return set()

_CACHE: dict[Edit, Any] = {}
_CHOSEN: dict[Any, Any] = {}  # probe -> the edit set this torch holds, or why none
_SHIPPED: dict[int, Any] = {}  # id of a probe's copy -> the function torch shipped (the copies live in _CACHE)
_LOCK = threading.RLock()  # held while torch is being patched or given back, never across a run
# How to give back each patch in force in this process, oldest first.
_UNDO: list[Callable[[], None]] = []


def _forget_in_child() -> None:
    """A process forked while a probe was in force (the worker pool's ranks
    are forked from the harness on CPU, and a pool restarted inside the
    gate's probed run inherits the patch) starts from torch as shipped: the
    probes in force in a child are the ones its messages name."""
    global _LOCK
    _LOCK = threading.RLock()
    while _UNDO:
        _UNDO.pop()()


os.register_at_fork(after_in_child=_forget_in_child)


@contextmanager
def _held(undo: Callable[[], None]) -> Iterator[None]:
    """A patch just made stays until the block ends, then ``undo`` gives it back."""
    _UNDO.append(undo)
    try:
        yield
    finally:
        with _LOCK:
            if undo in _UNDO:  # not in a child that forgot it at fork
                _UNDO.remove(undo)
                undo()


def _target(edit: Edit) -> tuple[Any, str, Any]:
    """(owner, attribute name, current object) of the edited function."""
    owner: Any = importlib.import_module(edit.module)
    *outer, name = edit.function.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, name, inspect.getattr_static(owner, name)


def _rewritten(edit: Edit) -> Any:
    """The edited copy of the function, compiled once per process against its module's globals."""
    if edit in _CACHE:
        return _CACHE[edit]
    owner, name, current = _target(edit)
    current = _SHIPPED.get(id(current), current)  # another probe's copy in force: read torch's own
    fn = current.__func__ if isinstance(current, (staticmethod, classmethod)) else current
    src = inspect.getsource(fn)  # edited as the file indents it, then dedented (a method's lines)
    for old, new in edit.changes:
        n = src.count(old)
        if n != 1:
            raise Unavailable(f"{edit.module}.{edit.function} on this torch does not hold the lines this probe "
                              f"changes exactly once ({n} times: {old.strip()[:80]!r})")
        src = src.replace(old, new)
    src = _undecorated(textwrap.dedent(src), edit)
    module = sys.modules[fn.__module__]
    scope = dict(module.__dict__)
    code = compile(src, f"<fix probe of {edit.module}.{edit.function}>", "exec")
    exec(code, scope)  # noqa: S102 - torch's own source with the probe's lines changed
    made = scope[fn.__name__]
    made.__qualname__ = fn.__qualname__
    if isinstance(current, staticmethod):
        made = staticmethod(made)
    elif isinstance(current, classmethod):
        made = classmethod(made)
    _CACHE[edit] = (current, made)
    _SHIPPED[id(made)] = current
    return _CACHE[edit]


# Decorators a probe may drop from the source it compiles: the method kind
# (put back from the attribute it replaces) and registrations (the probe
# swaps the registered entry itself, ``_registered_swapped``), which would
# otherwise run again.
_DROPPED_DECORATORS = ("@staticmethod", "@classmethod", "@register_decomposition")


def _undecorated(src: str, edit: Edit) -> str:
    """``src`` from its ``def`` on. Any other decorator wraps the function in
    behaviour a bare copy would lose, so such a function is not probed."""
    lines = src.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith(("def ", "async def ")))
    for line in lines[:start]:
        if line.startswith("@") and not line.startswith(_DROPPED_DECORATORS):
            raise Unavailable(f"{edit.module}.{edit.function} is decorated ({line.strip()[:60]}): "
                              "a copy of its source would drop what the decorator does")
    return "".join(lines[start:])


def _aliases(module: str, obj: Any) -> list[tuple[ModuleType, str]]:
    """Every torch module attribute that is ``obj`` (``from ._backward import
    stage_backward_weight`` binds a second name the schedule calls)."""
    root = module.split(".")[0]
    out = []
    for m in list(sys.modules.values()):
        if not isinstance(m, ModuleType) or not getattr(m, "__name__", "").startswith(root):
            continue
        for k, v in list(getattr(m, "__dict__", {}).items()):
            if v is obj:
                out.append((m, k))
    return out


def _swapped(owner: Any, name: str, new: Any, extra: list[tuple[Any, str]]) -> ContextManager[None]:
    with _LOCK:
        old = inspect.getattr_static(owner, name)
        places = [(owner, name)] + [x for x in extra if not (x[0] is owner and x[1] == name)]
        saved = [(o, k, inspect.getattr_static(o, k)) for o, k in places]
        for o, k in places:
            setattr(o, k, new)

    def undo() -> None:
        for o, k, v in saved:
            setattr(o, k, v)
        # A module first imported while the probe was in force bound the
        # probe's function by name (``from ._utils import ...``): give it back too.
        if isinstance(owner, ModuleType):
            for o, k in _aliases(owner.__name__, new):
                setattr(o, k, old)

    return _held(undo)


@contextmanager
def _edits_in_force(edits: tuple[Edit, ...]) -> Iterator[None]:
    with ExitStack() as stack:
        for edit in edits:
            owner, name, _ = _target(edit)
            current, made = _rewritten(edit)
            extra = _aliases(edit.module, current) if isinstance(owner, ModuleType) else []
            stack.enter_context(_swapped(owner, name, made, extra))
        yield


@contextmanager
def _function_swapped(module: str, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """``module.name`` (and its aliases) replaced by ``make(original)`` for what runs inside."""
    owner = importlib.import_module(module)
    current = getattr(owner, name)
    with _swapped(owner, name, make(current), _aliases(module, current)):
        yield


def _rms_norm_add_out_of_place(original: Any) -> Any:
    """``F.rms_norm`` on CPU as torch's composite (``rms_norm_symint`` in
    ATen's layer_norm.cpp) with its one in-place op, ``.add_(eps)`` into the
    mean's output, made out of place; CUDA's fused kernel is left alone."""
    import torch

    def rms_norm(input: Any, normalized_shape: Any, weight: Any = None, eps: float | None = None) -> Any:
        if input.device.type != "cpu":
            return original(input, normalized_shape, weight, eps)
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
        e = torch.finfo(x.dtype).eps if eps is None else eps
        out = x.mul(torch.rsqrt(x.pow(2).mean(dims, keepdim=True).add(e))).type_as(input)
        return out if weight is None else out.mul(weight)

    return rms_norm


def _norm_backward(g: Any, x: Any, p: float, y: Any, dim: Any, keepdim: bool) -> Any:
    """ATen's ``norm_backward`` (FunctionsManual.cpp) op for op, with its
    in-place ``masked_fill_`` and ``pow_`` made out of place: a DTensor keeps
    ``x / norm`` Partial when ``x`` is, and refuses an in-place op that would
    change that placement."""
    if not keepdim and x.dim() != 0 and dim:
        for d in sorted(d % x.dim() for d in ([dim] if isinstance(dim, int) else dim)):
            g, y = g.unsqueeze(d), y.unsqueeze(d)
    if p == 0.0:
        return None
    if p == 1.0:
        return x.sgn() * g
    if p == 2.0:
        return g * (x / y).masked_fill(y == 0, 0)
    if math.isinf(p):
        a = x.abs()
        mask = a.eq(y).logical_or(a.isnan())
        return x.sgn() * ((g / mask.sum(dim if dim else tuple(range(x.dim())), True)) * mask)
    if p < 1.0:
        return x.sgn() * x.abs().pow(p - 1).masked_fill(x == 0, 0) * g * y.pow(1 - p)
    scaled = x.sgn() * x.abs().pow(p - 1) if p < 2.0 else x * x.abs().pow(p - 2)
    return scaled * (g / y.pow(p - 1)).masked_fill(y == 0, 0)


def _vector_norm_kernel() -> Callable[..., Any]:
    """An autograd kernel for ``aten::linalg_vector_norm`` whose backward is
    ``_norm_backward``; the forward is torch's own, below autograd."""
    import torch

    class VectorNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, ord: Any, dim: Any, keepdim: bool, dtype: Any) -> Any:
            with torch._C._AutoDispatchBelowAutograd():
                y = torch.ops.aten.linalg_vector_norm.default(x, ord, dim, keepdim, dtype=dtype)
            ctx.save_for_backward(x, y)
            ctx.args = (float(ord), dim, keepdim)
            return y

        @staticmethod
        def backward(ctx: Any, g: Any) -> tuple[Any, ...]:
            x, y = ctx.saved_tensors
            p, dim, keepdim = ctx.args
            return _norm_backward(g, x, p, y, dim, keepdim), None, None, None, None

    def kernel(x: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
        return VectorNorm.apply(x, ord, dim, keepdim, dtype)

    return kernel


def _dist_kernel() -> Callable[..., Any]:
    """An autograd kernel for ``aten::dist`` whose backward is
    ``_norm_backward`` of ``self - other``, as derivatives.yaml writes it
    (``-`` of it for ``other``; the engine sums a broadcast grad back to
    each input's shape); the forward is torch's own, below autograd."""
    import torch

    class Dist(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, other: Any, p: Any) -> Any:
            with torch._C._AutoDispatchBelowAutograd():
                y = torch.ops.aten.dist.default(x, other, p)
            ctx.save_for_backward(x, other, y)
            ctx.p = float(p)
            return y

        @staticmethod
        def backward(ctx: Any, g: Any) -> tuple[Any, ...]:
            x, other, y = ctx.saved_tensors
            d = _norm_backward(g, x - other, ctx.p, y, None, False)
            return d, -d, None

    def kernel(x: Any, other: Any, p: Any = 2) -> Any:
        return Dist.apply(x, other, p)

    return kernel


@contextmanager
def _kernels_swapped(swaps: tuple[tuple[str, Callable[[], Callable[..., Any]]], ...], key: str) -> Iterator[None]:
    """``_kernel_swapped`` for several operators at once: one fix reached
    through more than one op's derivative."""
    with ExitStack() as stack:
        for op, make in swaps:
            stack.enter_context(_kernel_swapped(op, make, key))
        yield


def _mvlgamma_kernel() -> Callable[..., Any]:
    """An autograd kernel for ``aten::mvlgamma`` whose backward is ATen's
    ``mvlgamma_backward`` (FunctionsManual.cpp) op for op, with its in-place
    ``digamma_`` made out of place: on a Partial DTensor input the shifted
    arguments stay Partial, and DTensor refuses an in-place op that would
    change that placement. The forward is torch's own, below autograd."""
    import torch

    class Mvlgamma(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, p: int) -> Any:
            with torch._C._AutoDispatchBelowAutograd():
                y = torch.ops.aten.mvlgamma.default(x, p)
            ctx.save_for_backward(x)
            ctx.p = p
            return y

        @staticmethod
        def backward(ctx: Any, g: Any) -> tuple[Any, ...]:
            (x,) = ctx.saved_tensors
            args = torch.arange(-ctx.p / 2.0 + 0.5, 0.5, 0.5, dtype=x.dtype, device=x.device)
            args = args.add(x.unsqueeze(-1))
            return g * args.digamma().sum(-1), None

    def kernel(self: Any, p: int) -> Any:
        return Mvlgamma.apply(self, p)

    return kernel


def _tensor_split_kernel() -> Callable[..., Any]:
    """``aten::tensor_split.tensor_indices_or_sections`` as ATen's composite
    (TensorShape.cpp) writes it, reading the indices with ``item``/``tolist``
    instead of their data pointer, which a torch.func wrapper has none of."""
    import torch

    def kernel(self: Any, tensor_indices_or_sections: Any, dim: int = 0) -> Any:
        t = tensor_indices_or_sections
        if t.dim() == 0:
            return torch.ops.aten.tensor_split.sections(self, int(t.item()), dim)
        return torch.ops.aten.tensor_split.indices(self, t.tolist(), dim)

    return kernel


def _matmul_kernel() -> Callable[..., Any]:
    """``aten::matmul`` as torch's own Python port of ATen's composite
    (``torch._decomp.decompositions.matmul``, the one tracing runs): the
    same branches and kernels, but its vector-times-matrix branch squeezes
    the ``mm`` output out of place, where ATen's ``squeeze_`` mutates it."""
    from torch._decomp.decompositions import matmul

    def kernel(self: Any, other: Any) -> Any:
        return matmul(self, other)

    return kernel


def _inf_norm_of_nothing(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """The local norm a rank computes, with an empty piece giving 0 to an
    infinity norm (the largest absolute value: the ranks' maxima are what
    the reduction then takes), where the kernels refuse an empty tensor."""
    try:
        return op_call(*args, **kwargs)
    except RuntimeError:
        ords = args[1:2] or [kwargs.get("ord", 2)]
        if not math.isinf(float(ords[0])):
            raise
        x = args[0]
        if isinstance(x, (list, tuple)):  # _foreach_norm: the non-empty ones as the kernel makes them
            done = iter(op_call([t for t in x if t.numel()], *args[1:], **kwargs))
            return [next(done) if t.numel() else t.new_zeros(()) for t in x]
        if x.numel():
            raise
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
        keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
        dims = range(x.dim()) if dim is None else [d % x.dim() for d in ([dim] if isinstance(dim, int) else dim)]
        shape = [1 if d in dims else n for d, n in enumerate(x.shape) if keepdim or d not in dims]
        return x.new_zeros(shape, dtype=kwargs.get("dtype") or x.dtype)


def _dispatched_as_dtensor(op_call: Any, args: tuple, kwargs: dict, local_op: Callable[..., Any]) -> Any:
    """``op_call`` dispatched as DTensor dispatches it (sharding propagation,
    the redistribution it asks for, the local op, the wrap), with the local
    op run by ``local_op(op_call, local_args, local_kwargs)``."""
    import torch.utils._pytree as pytree
    from torch.distributed.tensor import DTensor

    d = DTensor._op_dispatcher
    op_info = d.unwrap_to_op_info(op_call, args, kwargs)
    d.sharding_propagator.propagate(op_info)
    out = op_info.output_sharding
    if out.needs_redistribute:
        d.redistribute_local_args(op_info, out.redistribute_schema, out.use_val_from_redistribute_schema)
    local = (pytree.tree_unflatten(list(op_info.local_args), op_info.args_tree_spec)
             if op_info.args_tree_spec else op_info.local_args)
    return d.wrap(local_op(op_call, tuple(local), op_info.local_kwargs), out.output_spec)


def _empty_shard_norm_handler() -> Callable[..., Any]:
    """A DTensor handler for the norm ops with the local op as
    ``_inf_norm_of_nothing`` runs it."""
    return lambda op_call, args, kwargs: _dispatched_as_dtensor(op_call, args, kwargs, _inf_norm_of_nothing)


def _linear_foreach_mul_handler() -> Callable[..., Any]:
    """A DTensor handler for ``_foreach_mul_`` by a Replicate scalar that
    scales each piece where it is: scaling is linear, so a Partial(sum)
    grad stays Partial, a shard stays a shard. Any other call is dispatched
    as DTensor does."""
    from torch.distributed.tensor import DTensor

    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        selfs, other = args[0], args[1]
        if isinstance(other, DTensor) and other.numel() == 1 and all(p.is_replicate() for p in other.placements) \
                and all(isinstance(t, DTensor) and t.device_mesh == other.device_mesh for t in selfs):
            for t in selfs:
                t._local_tensor.mul_(other._local_tensor)
            return None
        return _dispatched_as_dtensor(op_call, args, kwargs, lambda op, a, k: op(*a, **k))

    return handler


def _in_place_keeps_placement_handler() -> Callable[..., Any]:
    """A DTensor handler for ``scatter_add_`` that computes the result out
    of place (the sharding the op asks for), then writes it into ``self``
    in ``self``'s own placements: an in-place op changes values, never the
    layout autograd recorded for ``self``."""
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        self = args[0]
        out = _aten("scatter_add.default")()(*args, **kwargs)
        self._local_tensor.copy_(redistribute_local_tensor(out._local_tensor, out._spec, self._spec))
        return self

    return handler


@contextmanager
def _handler_added(ops: tuple[str, ...], make: Callable[[], Callable[..., Any]]) -> Iterator[None]:
    """``make()`` as DTensor's handler of each aten op in ``ops`` (refused
    where DTensor has a handler of its own for one) for what runs inside."""
    keys = [_aten(op)() for op in ops]
    table = _dtensor_handlers()[0]
    with _LOCK:
        if any(k in table for k in keys):
            raise Unavailable(f"DTensor already has a handler of its own for one of {', '.join(ops)}")
        handler = make()
        table.update({k: handler for k in keys})

    def undo() -> None:
        for k in keys:
            table.pop(k, None)

    with _held(undo):
        yield


@contextmanager
def _kernel_swapped(op: str, make: Callable[[], Callable[..., Any]], key: str) -> Iterator[None]:
    """``make()`` as aten ``op``'s kernel at dispatch ``key`` for what runs
    inside: a derivative (derivatives.yaml) or composite torch writes in C++
    has no Python function to edit, but the dispatcher takes a Python kernel
    in its place, and dropping the registration gives torch's own back."""
    import torch

    name, _, overload = op.partition(".")
    if not hasattr(getattr(torch.ops.aten, name, None), overload or "default"):
        raise Unavailable(f"aten::{op} is not an operator of this torch")
    with _LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": what the probe is
        lib = torch.library.Library("aten", "IMPL")
        lib.impl(op, make(), key)
    with _held(lib._destroy):
        yield


@contextmanager
def _registered_swapped(edit: Edit, tables: Callable[[], list[dict[Any, Any]]], op: Callable[[], Any]) -> Iterator[None]:
    """The edited function in force where it is registered, not only where it
    is defined: a decomposition table holds the function object itself (and
    Inductor keeps a cached copy of its table beside it)."""
    current, made = _rewritten(edit)
    key = op()
    with _LOCK:
        held = [t for t in tables() if t.get(key) is current]
        if not held:
            raise Unavailable(f"{edit.module}.{edit.function} is not registered for {key} on this torch")
        for t in held:
            t[key] = made

    def undo() -> None:
        for t in held:
            t[key] = current

    with _held(undo):
        yield


@contextmanager
def _recompiled(patch: ContextManager[None]) -> Iterator[None]:
    """``patch`` in force for a compiler: what was compiled before it (dynamo's
    code caches, and the on-disk FX graph and AOTAutograd caches, whose keys do
    not see a changed decomposition) is not reused under it, and nothing
    compiled under it outlives it."""
    import torch
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    torch._dynamo.reset()
    try:
        with inductor_config.patch(fx_graph_cache=False), \
                functorch_config.patch(enable_autograd_cache=False), patch:
            yield
    finally:
        torch._dynamo.reset()


@contextmanager
def _entry_removed(tables: Callable[[], list[dict[Any, Any]]], op: Callable[[], Any]) -> Iterator[None]:
    """``op`` left out of the compiler's ``tables`` for what runs inside: the
    compiler then runs the aten kernel for it instead of its decomposition."""
    key = op()
    with _LOCK:
        held = [(t, t.pop(key)) for t in tables() if key in t]
        if not held:
            raise Unavailable(f"no table holds {key} on this torch")

    def undo() -> None:
        for t, v in held:
            t[key] = v

    with _held(undo):
        yield


@contextmanager
def _together(*patches: ContextManager[None]) -> Iterator[None]:
    """Several patches that make one fix, in force together."""
    with ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


def _dtensor_handlers() -> list[dict[Any, Any]]:
    from torch.distributed.tensor import DTensor

    return [DTensor._op_dispatcher._custom_op_handlers]


def _inductor_tables() -> list[dict[Any, Any]]:
    from torch._inductor import decomposition

    return [decomposition.decompositions, decomposition.fast_random_decomps()]


def _aten(name: str) -> Callable[[], Any]:
    def op() -> Any:
        import torch

        packet, overload = name.split(".")
        return getattr(getattr(torch.ops.aten, packet), overload)

    return op


# --- the probes -----------------------------------------------------------------------

_BACKWARD = "torch.distributed.pipelining._backward"
_CONV_HANDLER = Edit("torch.distributed.tensor._tp_conv", "convolution_handler",
                     (("    # local propagation\n    local_results = tp_convolution(\n",
                       "    if output_sharding.needs_redistribute:\n"
                       "        dtensor.DTensor._op_dispatcher.redistribute_local_args(\n"
                       "            op_info, output_sharding.redistribute_schema,\n"
                       "            output_sharding.use_val_from_redistribute_schema)\n"
                       "    # local propagation\n    local_results = tp_convolution(\n"),))
_CONV_BACKWARD_HANDLER = Edit(
    "torch.distributed.tensor._tp_conv", "convolution_backward_handler",
    (("    args[0] = args[0].redistribute(args[1].device_mesh, args[1].placements)\n",
      "    if any(p.is_partial() for p in args[1].placements):  # reduced, as the forward's propagation did\n"
      "        args[1] = args[1].redistribute(args[1].device_mesh, [\n"
      "            torch.distributed.tensor.Replicate() if p.is_partial() else p for p in args[1].placements])\n"
      "    args[0] = args[0].redistribute(args[1].device_mesh, args[1].placements)\n"),
     ("    # local propagation\n    local_results = tp_convolution_backward(\n",
      "    _dim_map = op_info.flat_args_schema[0].dim_map\n"
      "    if output_sharding.needs_redistribute:\n"
      "        dtensor.DTensor._op_dispatcher.redistribute_local_args(\n"
      "            op_info, output_sharding.redistribute_schema,\n"
      "            output_sharding.use_val_from_redistribute_schema)\n"
      "        _dim_map = output_sharding.redistribute_schema.args_schema[0].dim_map\n"
      "    # local propagation\n    local_results = tp_convolution_backward(\n"),
     ("        op_info.flat_args_schema[0].dim_map,\n    )\n", "        _dim_map,\n    )\n")))
_INDEX_ADD = Edit("torch._inductor.decomposition", "index_add",
                  (("    if not is_fbcode() and x.dtype == torch.bfloat16:\n", "    if True:\n"),))


@contextmanager
def _sharding_decisions_forgotten() -> Iterator[None]:
    """DTensor caches each op's sharding decision by its schema: a probe that
    changes a strategy must meet no decision made without it, and leave none
    made with it. Both caches are per thread, and autograd runs a CUDA
    tensor's backward on its device's own thread, so they are cleared there
    too (``_on_device_threads``): cleared only on the caller's thread, a
    layer norm backward on a CUDA device keeps the decision made before the
    probe, and after it the one made under it."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache as forget  # Python's and C++'s

    _on_device_threads(forget)
    try:
        yield
    finally:
        _on_device_threads(forget)


def _on_device_threads(fn: Callable[[], Any]) -> None:
    """``fn()`` here and on the autograd engine's thread of the current CUDA
    device (a backward through a tensor on that device runs its nodes there)."""
    import torch

    fn()
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return

    class _There(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            fn()
            return g

    # The current device: a rank computes on its own (a context on every
    # device would cost each rank memory on its peers' GPUs).
    _There.apply(torch.zeros(1, device="cuda", requires_grad=True)).sum().backward()


def _clamped_saved_grads(condition: str) -> tuple[Edit, ...]:
    """Before 2.13, stage_backward_weight ran the weight pass from the
    intermediates' grads the input pass saved without holding the
    intermediates to them, so autograd added what flowed in from another
    intermediate below. These lines hold each intermediate's grad outputs
    to the saved ones for the pass (where ``condition`` holds), as 2.13's
    clamp does."""
    return (Edit(_BACKWARD, "stage_backward_weight",
                 (("        del param_group[\"intermediates\"]\n",
                   "        _saved = list(zip(param_group[\"grads\"], param_group[\"intermediates\"]))\n"
                   "        del param_group[\"intermediates\"]\n"),
                  ("            # [NEW!] Able to pass a GradientEdge to autograd.grad as output\n",
                   "            _clamps = ([i.register_prehook(lambda grad_outputs, sg=g: sg) for g, i in _saved]\n"
                   f"                       if {condition} else [])\n"),
                  ("            # release grad memory early after use\n",
                   "            for _h in _clamps:\n"
                   "                _h.remove()\n"))),)


# 2.13 put these lines of stage_backward_input and stage_backward_weight in a
# try block; in 2.11's source the same lines sit four columns further left.
_TRY_WRAPPED = ("stage_backward_input", "stage_backward_weight")


def _before_the_try(edits: tuple[Edit, ...]) -> tuple[Edit, ...]:
    """A probe's edits written against 2.11's stage_backward source."""
    def left(text: str) -> str:
        return "".join(line[4:] if line.startswith("    ") else line for line in text.splitlines(keepends=True))

    return tuple(Edit(e.module, e.function, tuple((left(o), left(n)) for o, n in e.changes))
                 if e.module == _BACKWARD and e.function in _TRY_WRAPPED else e for e in edits)


# Shared by a probe's current and older edit sets: these lines are the same in both releases.
_GROUP_MERGED = Edit(_BACKWARD, "get_param_groups",
                     (("                param_group = existing\n",
                       "                param_group = existing\n"
                       "                for node in existing[\"intermediates\"]:\n"
                       "                    param_groups[node] = existing\n"),))
_UNREACHED_WEIGHT_PASS = Edit(_BACKWARD, "stage_backward_weight",
                              (("    for param_group in param_groups:\n",
                                "    for param_group in param_groups:\n"
                                "        if \"outputs\" in param_group:\n"
                                "            _edges, _grads = zip(*param_group.pop(\"outputs\"))\n"
                                "            _params = list(param_group[\"params\"])\n"
                                "            _dws = torch.autograd.grad(list(_edges), tuple(GradientEdge(w, 0) for w in _params),\n"
                                "                                       grad_outputs=list(_grads), retain_graph=retain_graph,\n"
                                "                                       allow_unused=True)\n"
                                "            for grad_acc, dw in zip(_params, _dws):\n"
                                "                weight, index = grad_acc_to_weight[grad_acc]\n"
                                "                if dw is None:\n"
                                "                    continue\n"
                                "                if weight.grad is None:\n"
                                "                    weight.grad = dw\n"
                                "                else:\n"
                                "                    weight.grad += dw\n"
                                "            continue\n"),))
_GROUPS_APART = (Edit(_BACKWARD, "stage_backward_weight",
                      (("                    retain_graph=retain_graph,\n",
                        "                    retain_graph=retain_graph or param_group is not param_groups[-1],\n"),)),
                 _GROUP_MERGED,)
_DETACH_NO_VIEWS = (Edit(_BACKWARD, "stage_backward_input",
                         (("            t.detach_()\n", "            if not t._is_view():\n                t.detach_()\n"),)),)
_KEEP_OUTPUTS_ATTACHED = (Edit(_BACKWARD, "stage_backward_input",
                               (("            t.detach_()\n", "            pass\n"),)),
                          Edit("torch.distributed.pipelining.stage", "_PipelineStageBase.backward_one_chunk",
                               (("                    t.detach_()\n", "                    pass\n"),)))
_GRAD_LIKE_PARAM = (Edit(_BACKWARD, "stage_backward_weight",
                         (("                        weight.grad = dw\n",
                           "                        weight.grad = (dw if dw.stride() == weight.stride()\n"
                           "                                       else torch.empty_like(weight).copy_(dw))\n"),)),)

def _fp16_engine_scales_loss() -> ContextManager[None]:
    """``DeepSpeedEngine.backward`` multiplies the loss by the fp16
    optimizer's scale when that optimizer is ZeRO 0's (not a ZeROOptimizer),
    as it does for ZeRO's; its step divides by that scale either way. A
    wrapper, not an edit: ``backward`` is decorated (``instrument_w_nvtx``)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    shipped = inspect.getattr_static(DeepSpeedEngine, "backward")

    def backward(self: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.optimizer, FP16_UnfusedOptimizer):
            loss = loss.float() * self.optimizer.loss_scale
        return shipped(self, loss, *args, **kwargs)

    return _swapped(DeepSpeedEngine, "backward", backward, [])


_ZERO_STEP = "deepspeed.runtime.zero.stage_1_and_2"


PROBES: dict[str, Probe] = {p.name: p for p in (
    Probe("deepspeed-fp16-engine-scales-loss",
          "DeepSpeedEngine.backward multiplies the loss by the loss scale for ZeRO 0's fp16 optimizer too "
          "(FP16_UnfusedOptimizer, whose step divides the grads by that scale)",
          custom=_fp16_engine_scales_loss),
    Probe("deepspeed-fp16-scale-updated-after-step",
          "FP16_UnfusedOptimizer.step (ZeRO 0's fp16 optimizer) raises the loss scale after the grads are "
          "unscaled, so they are divided by the scale they were multiplied by",
          (Edit("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer.step", (
              ("        self._update_scale(False)\n        self.unscale_and_clip_grads(self._global_grad_norm)\n",
               "        self.unscale_and_clip_grads(self._global_grad_norm)\n        self._update_scale(False)\n"),)),)),
    Probe("deepspeed-zero-scale-updated-after-step",
          "DeepSpeedZeroOptimizer.step raises or lowers the loss scale after the grads are unscaled and applied "
          "(on overflow, before it returns), so they are divided by the scale they were multiplied by",
          (Edit(_ZERO_STEP, "DeepSpeedZeroOptimizer.step", (
              ("        prev_scale = self.loss_scale\n        self._update_scale(self.overflow)\n",
               "        prev_scale = self.loss_scale\n        if self.overflow:\n"
               "            self._update_scale(self.overflow)\n"),
              ("        self.timers.log(OPTIMIZER_TIMERS)\n",
               "        self._update_scale(self.overflow)\n        self.timers.log(OPTIMIZER_TIMERS)\n"))),)),
    Probe("deepspeed-zero-skip-unallocated-bucket",
          "DeepSpeedZeroOptimizer.reduce_ipg_grads skips a contiguous IPG bucket no gradient hook allocated "
          "(a backward that reached no trainable parameter) instead of indexing its empty buffer list",
          (Edit(_ZERO_STEP, "DeepSpeedZeroOptimizer.reduce_ipg_grads", (
              ("                    self.average_tensor(bucket.buffer[bucket.index].narrow(0, 0, bucket.elements), comm_dtype)\n",
               "                    if bucket.buffer:\n"
               "                        self.average_tensor(bucket.buffer[bucket.index].narrow(0, 0, bucket.elements), "
               "comm_dtype)\n"),)),)),
    Probe("sgd-nesterov-foreach-out-of-place",
          "SGD's foreach step adds the momentum buffer to the grads out of place for Nesterov, so .grad keeps "
          "what backward left there",
          (Edit("torch.optim.sgd", "_multi_tensor_sgd",
                (("torch._foreach_add_(device_grads, bufs, alpha=momentum)",
                  "device_grads = torch._foreach_add(device_grads, bufs, alpha=momentum)"),)),)),
    Probe("split-clamp-saved-grads",
          "stage_backward_weight holds the intermediates of a group of several to the grads the input pass saved "
          "for the weight pass (2.13's clamp, pytorch#181365, in an older release's source)",
          _clamped_saved_grads('len(_saved) > 1')),
    Probe("split-edge-per-output",
          "stage_backward_weight runs the weight pass from each output of an intermediate with that output's own "
          "grad, not from output 0 with the sum (2.13's per-output edges, in an older release's source)",
          (Edit(_BACKWARD, "stage_backward_weight",
                (("            non_none_grads = [g for g in grads_tuple if g is not None]\n"
                  "            if non_none_grads:\n"
                  "                summed_grad = sum(non_none_grads)\n"
                  "                valid_edges.append(GradientEdge(intermediate, 0))\n",
                  "            for _i, _g in enumerate(grads_tuple):\n"
                  "                if _g is None:\n"
                  "                    continue\n"
                  "                summed_grad = _g\n"
                  "                valid_edges.append(GradientEdge(intermediate, _i))\n"),)),)),
    Probe("split-input-grads-allow-unused",
          "stage_backward_input asks autograd for input grads with allow_unused and leaves an unused input's grad "
          "alone (2.13's input pass, in an older release's source)",
          (Edit(_BACKWARD, "stage_backward_input",
                (("        retain_graph=True,\n    )\n", "        retain_graph=True,\n        allow_unused=True,\n    )\n"),
                 ("    for inp, dinput in zip(input_values, dinputs):\n",
                  "    for inp, dinput in zip(input_values, dinputs):\n        if dinput is None:\n            continue\n"))),)),
    Probe("split-outputs-with-grad-only",
          "stage_backward_input passes autograd only the stage outputs that need a grad, with their grads "
          "(2.13's input pass, in an older release's source)",
          (Edit(_BACKWARD, "stage_backward_input",
                (("    dinputs = torch.autograd.grad(\n        stage_outputs_or_loss,\n",
                  "    _kept = [(o, g) for o, g in zip(stage_outputs_or_loss, output_grads)\n"
                  "             if o.requires_grad or o.grad_fn is not None]\n"
                  "    dinputs = torch.autograd.grad(\n        [o for o, _ in _kept],\n"),
                 ("        grad_outputs=output_grads,\n", "        grad_outputs=[g for _, g in _kept],\n"))),)),
    Probe("split-input-grads-per-input",
          "stage_backward_input returns one grad per stage input, None for an input that needs none, so a caller "
          "pairing them by position pairs them right (2.13's input pass, in an older release's source)",
          (Edit(_BACKWARD, "stage_backward_input",
                (("    input_values = [inp for inp in input_values if inp.requires_grad]\n",
                  "    _every_input = input_values\n"
                  "    input_values = [inp for inp in input_values if inp.requires_grad]\n"),
                 ("    return dinputs, param_groups\n",
                  "    _by_input = dict(zip(map(id, input_values), dinputs))\n"
                  "    return tuple(_by_input.get(id(i)) for i in _every_input), param_groups\n"))),)),
    Probe("pipeline-output-meta-real-strides",
          "PipelineStage's shape inference records each stage output with its real strides (2.13's tensor "
          "metadata, in an older release's source) instead of the dense ones .to('meta') gives",
          (Edit("torch.distributed.pipelining.stage", "PipelineStage._shape_inference",
                (("lambda x: x.to(\"meta\"), outputs)",
                  "lambda x: torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=\"meta\"), outputs)"),)),)),
    Probe("pipeline-recv-buffers-need-grad",
          "PipelineStage sets requires_grad on its receive buffers again at every step of a stage with a backward "
          "(2.13 re-applies it each step), so a buffer a passthrough output detached in place still takes a grad",
          (Edit("torch.distributed.pipelining.stage", "_PipelineStageBase._retrieve_recv_activations",
                (("        activations = self._map_tensor_from_recv_info(recv_infos)\n",
                  "        if self.has_backward:\n"
                  "            for _info in recv_infos:\n"
                  "                _buf = getattr(_info, \"buffer\", None)\n"
                  "                if isinstance(_buf, torch.Tensor) and not _buf.requires_grad:\n"
                  "                    _buf.requires_grad_(True)\n"
                  "        activations = self._map_tensor_from_recv_info(recv_infos)\n"),)),)),
    Probe("dtensor-norm-backward-replicated-weight",
          "DTensor's norm backward strategy asks for the weight replicated (redistributing a sharded one, as 2.13's "
          "single-dim strategy does) instead of handing the local kernel the weight's own shard",
          custom=lambda: _together(_sharding_decisions_forgotten(), _edits_in_force((Edit(
              "torch.distributed.tensor._ops._math_ops", "_common_norm_backward_strategy",
              (("            # no need to redistribute since they should be replicated in forward pass\n"
                "            input_specs_list.append(src_spec)\n"
                "            redistribute_costs.append([0.0 for _ in strategy.strategies])\n"
                "            return src_spec\n",
                "            _whole = DTensorSpec(mesh=mesh, placements=(Replicate(),) * mesh.ndim,\n"
                "                                 tensor_meta=src_spec.tensor_meta)\n"
                "            input_specs_list.append(_whole)\n"
                "            redistribute_costs.append(generate_redistribute_costs(strategy, _whole))\n"
                "            return _whole\n"),)),)))),
    Probe("split-clamp-every-intermediate",
          "stage_backward_weight clamps the grad of every captured intermediate to the one the input pass saved, "
          "not only when there are several (a tensor hook on it then runs once)",
          (Edit(_BACKWARD, "stage_backward_weight",
                (("if len(param_group[\"intermediates\"]) > 1:", "if True:"),)),),
          older=_clamped_saved_grads("True")),
    Probe("split-param-groups-apart",
          "get_param_groups points every intermediate of a merged group at the merged group (no parameter left in "
          "two groups), and stage_backward_weight keeps the graph until the last group's pass (groups sharing a "
          "region of the graph no longer find it freed)",
          _GROUPS_APART, older=_before_the_try(_GROUPS_APART)),
    Probe("split-group-unreached-weights",
          "stage_backward_input puts the weights that no weight group holds (their graph never meets a stage input "
          "that needs grad) in one more group, run from the stage outputs with their grads, and "
          "stage_backward_weight runs that group",
          (Edit(_BACKWARD, "stage_backward_input",
                (("        # drop output side graph state we no longer need\n",
                  "        _grouped = set().union(*(g[\"params\"] for g in param_groups))\n"
                  "        _left = [w for w in weight_grad_fns if w not in _grouped]\n"
                  "        _outs = [(GradientEdge(o.grad_fn, o.output_nr), g)\n"
                  "                 for o, g in zip(valid_outputs, valid_output_grads) if o.grad_fn is not None]\n"
                  "        if _left and _outs:\n"
                  "            param_groups.append({\"params\": set(_left), \"outputs\": _outs})\n"
                  "        # drop output side graph state we no longer need\n"),)),
           _UNREACHED_WEIGHT_PASS,),
          older=(Edit(_BACKWARD, "stage_backward_input",
                      (("    # stage_outputs_or_loss are not used in backwards after this point",
                        "    _grouped = set().union(*(g[\"params\"] for g in param_groups))\n"
                        "    _left = [w for w in weight_grad_fns if w not in _grouped]\n"
                        "    _outs = [(GradientEdge(o.grad_fn, o.output_nr), g)\n"
                        "             for o, g in zip(stage_outputs_or_loss, output_grads) if o.grad_fn is not None]\n"
                        "    if _left and _outs:\n"
                        "        param_groups.append({\"params\": set(_left), \"outputs\": _outs})\n"
                        "    # stage_outputs_or_loss are not used in backwards after this point"),)),
                 _UNREACHED_WEIGHT_PASS)),
    Probe("split-detach-no-views",
          "stage_backward_input leaves a stage output that is a view attached instead of detaching it in place "
          "(which autograd refuses for views)",
          _DETACH_NO_VIEWS, older=_before_the_try(_DETACH_NO_VIEWS)),
    Probe("split-keep-outputs-attached",
          "stage_backward_input (and a last stage's backward_one_chunk) no longer detach the stage outputs in place, "
          "so an output saved for the backward of another output is still there in the weight pass",
          _KEEP_OUTPUTS_ATTACHED, older=_before_the_try(_KEEP_OUTPUTS_ATTACHED)),
    Probe("rms-norm-add-eps-out-of-place",
          "F.rms_norm on CPU runs torch's composite with the eps added out of place (torch adds it in place into "
          "the mean's output)",
          custom=lambda: _function_swapped("torch.nn.functional", "rms_norm", _rms_norm_add_out_of_place)),
    Probe("norm-backward-out-of-place",
          "linalg_vector_norm's and dist's backward is ATen's norm_backward with its in-place masked_fill_ made out "
          "of place (Python autograd kernels for the two operators, the same ops in the same order otherwise)",
          custom=lambda: _kernels_swapped((("linalg_vector_norm", _vector_norm_kernel), ("dist", _dist_kernel)),
                                          "Autograd")),
    Probe("dtensor-inf-norm-of-empty-shard",
          "a rank whose DTensor piece is empty gives 0 to an infinity norm (linalg_vector_norm, _foreach_norm) "
          "instead of calling the kernel that refuses an empty tensor; DTensor's reduction across ranks then takes "
          "the largest (a handler that dispatches as DTensor does otherwise)",
          custom=lambda: _handler_added(("linalg_vector_norm.default", "_foreach_norm.Scalar"),
                                        _empty_shard_norm_handler)),
    Probe("dtensor-foreach-mul-linear",
          "DTensor's in-place _foreach_mul_ by a Replicate scalar scales each piece where it is (a linear op keeps "
          "a Partial grad Partial) instead of reducing a Partial grad into a temporary it then drops",
          custom=lambda: _handler_added(("_foreach_mul_.Tensor",), _linear_foreach_mul_handler)),
    Probe("dtensor-in-place-keeps-placement",
          "DTensor's in-place scatter_add_ computes the result out of place and writes it into self in self's own "
          "placements, instead of changing self's placements in place",
          custom=lambda: _handler_added(("scatter_add_.default",), _in_place_keeps_placement_handler)),
    Probe("mvlgamma-backward-out-of-place",
          "mvlgamma's backward is ATen's mvlgamma_backward with its in-place digamma_ made out of place "
          "(a Python autograd kernel for the operator, the same ops in the same order otherwise)",
          custom=lambda: _kernel_swapped("mvlgamma", _mvlgamma_kernel, "Autograd")),
    Probe("tensor-split-indices-as-list",
          "tensor_split with a tensor of indices reads them with tolist() (or item() for a section count) and "
          "splits by the list, as ATen's composite does through their data pointer",
          custom=lambda: _kernel_swapped("tensor_split.tensor_indices_or_sections", _tensor_split_kernel,
                                         "CompositeImplicitAutograd")),
    Probe("matmul-vector-squeeze-out-of-place",
          "torch.matmul of a vector and a matrix (and F.linear of a 1-D input) squeezes the mm output out of place: "
          "aten::matmul runs torch's Python port of its composite (torch._decomp), which ATen's squeeze_ differs from",
          custom=lambda: _kernel_swapped("matmul", _matmul_kernel, "CompositeImplicitAutograd")),
    Probe("pipeline-keep-grads-through-metadata-inference",
          "the schedule's first step gives back every parameter .grad that PipelineStage's cleanup after metadata "
          "inference set to None, as it was before the inference",
          (Edit("torch.distributed.pipelining.schedules", "_PipelineSchedule._initialize_pp_stages",
                (("        with torch.random.fork_rng(devices=devices, device_type=device_type):\n",
                  "        _held = [(p, p.grad.detach().clone()) for stage in stages for p in stage.submod.parameters()\n"
                  "                 if p.grad is not None]\n"
                  "        with torch.random.fork_rng(devices=devices, device_type=device_type):\n"),
                 ("                stage._post_metadata_inference_cleanup()\n",
                  "                stage._post_metadata_inference_cleanup()\n"
                  "        for p, g in _held:\n"
                  "            if p.grad is None:\n"
                  "                p.grad = g\n"))),)),
    Probe("fsdp2-post-backward-no-materialized-grads",
          "FSDP2's RegisterPostBackwardFunction calls ctx.set_materialize_grads(False) (the upstream fix, "
          "pytorch#133498), so an input or parameter a unit never used gets no zero grad",
          (Edit("torch.distributed.fsdp._fully_shard._fsdp_param_group", "RegisterPostBackwardFunction.setup_context",
                (("        ctx.param_group = param_group\n",
                  "        ctx.param_group = param_group\n"
                  "        ctx.set_materialize_grads(False)\n"),)),),
          older=(Edit("torch.distributed.fsdp._fully_shard._fsdp_param_group",
                      "RegisterPostBackwardFunction.forward",
                      (("        ctx.param_group = param_group\n",
                        "        ctx.param_group = param_group\n        ctx.set_materialize_grads(False)\n"),)),)),
    Probe("ddp-sink-skipped-under-no-sync",
          "DistributedDataParallel._post_forward skips _DDPSink (and the static graph's delayed all-reduce it "
          "queues) in a forward under no_sync(), as the forward's prepare_for_backward is skipped there "
          "(the fix proposed upstream, pytorch#166388)",
          (Edit("torch.nn.parallel.distributed", "DistributedDataParallel._post_forward",
                (("        if (self.find_unused_parameters and not self.static_graph) or (\n"
                  "            self.static_graph and not self._static_graph_delay_allreduce_enqueued\n"
                  "        ):\n",
                  "        if self.require_backward_grad_sync and ((self.find_unused_parameters and not self.static_graph) or (\n"
                  "            self.static_graph and not self._static_graph_delay_allreduce_enqueued\n"
                  "        )):\n"),)),)),
    Probe("pipeline-p2p-dense",
          "PipelineStage sends activations and input grads contiguous and allocates its receive buffers dense, "
          "whatever strides the sender's tensor had",
          (Edit("torch.distributed.pipelining.stage", "_PipelineStageBase.get_fwd_send_ops",
                (("send_tensor = to_local_if_dtensor(out, detach=True)\n",
                  "send_tensor = to_local_if_dtensor(out, detach=True).contiguous()\n"),)),
           Edit("torch.distributed.pipelining.stage", "_PipelineStageBase.get_bwd_send_ops",
                (("send_tensor = to_local_if_dtensor(grad)\n",
                  "send_tensor = to_local_if_dtensor(grad).contiguous()\n"),)),
           Edit("torch.distributed.pipelining._utils", "_make_tensor_from_meta",
                (("    return torch.empty_strided(\n        size=meta.shape,\n        stride=meta.stride,\n",
                  "    return torch.empty(\n        size=meta.shape,\n"),))),
          older=(Edit("torch.distributed.pipelining.stage", "_PipelineStageBase.get_fwd_send_ops",
                      (("dist.P2POp(dist.isend, out, peer_global_rank, self.group)",
                        "dist.P2POp(dist.isend, out.contiguous(), peer_global_rank, self.group)"),)),
                 Edit("torch.distributed.pipelining.stage", "_PipelineStageBase.get_bwd_send_ops",
                      (("dist.P2POp(dist.isend, grad, peer_global_rank, self.group)",
                        "dist.P2POp(dist.isend, grad.contiguous(), peer_global_rank, self.group)"),)))),
    Probe("inductor-index-add-fallback",
          "Inductor's index_add decomposition falls back to the aten kernel (as it does for bfloat16) instead of "
          "an index_put into self's own buffer",
          custom=lambda: _recompiled(_registered_swapped(_INDEX_ADD, _inductor_tables, _aten("index_add.default")))),
    Probe("inductor-frexp-exponent-vectors",
          "Inductor's vectorized frexp holds the int32 exponent in as many vectors as int32 takes, not as many "
          "as the input's dtype (two for float64, where the kernel's conversions of it expect one)",
          custom=lambda: _recompiled(_edits_in_force((Edit("torch._inductor.codegen.cpp", "CppVecOverrides.frexp", (
              ("        n_vec = V.kernel._get_num_vectors(x.dtype)\n",
               "        n_vec = V.kernel._get_num_vectors(x.dtype)\n"
               "        n_exp = V.kernel._get_num_vectors(torch.int32)\n"),
              ('            if n_vec == 1\n            else f"at::vec::VectorizedN<int32_t, {n_vec}> {exponent};"',
               '            if n_exp == 1\n            else f"at::vec::VectorizedN<int32_t, {n_exp}> {exponent};"'),
              ("                if n_vec == 1\n                else f\"{exponent} = at::vec::VectorizedN<int32_t, {n_vec}>",
               "                if n_exp == 1\n                else f\"{exponent} = at::vec::VectorizedN<int32_t, {n_exp}>"))),)))),
    Probe("inductor-embedding-backward-fallback",
          "Inductor runs embedding_dense_backward as the aten kernel instead of its decomposition",
          custom=lambda: _recompiled(_entry_removed(_inductor_tables, _aten("embedding_dense_backward.default")))),
    Probe("fsdp2-own-storage-for-adopted-grads",
          "FSDPParam.to_accumulated_grad_if_needed (FSDP2 runs it after a backward it does not reduce, a no-sync "
          "window) gives each unsharded parameter's .grad a storage of its own, so a view AccumulateGrad adopted "
          "(two parameters' grads in one expanded buffer) is not written through by the next microbatch's sum",
          (Edit("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam.to_accumulated_grad_if_needed",
                (("        # prefer to reshard before upcasting the gradient to save memory\n",
                  "        # prefer to reshard before upcasting the gradient to save memory\n"
                  "        if self._unsharded_param.grad is not None:\n"
                  "            self._unsharded_param.grad = self._unsharded_param.grad.clone()\n"),)),)),
    Probe("fsdp2-clone-outputs-of-unsharded-params",
          "FSDP2's post_forward clones a unit's output that shares storage with the unit's unsharded parameters "
          "before it reshards them (frees that storage)",
          (Edit("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup.post_forward",
                (("            if not is_bw():\n                self.reshard()\n",
                  "            if not is_bw():\n"
                  "                _held = {fp._unsharded_param.untyped_storage().data_ptr() for fp in self.fsdp_params\n"
                  "                         if hasattr(fp, \"_unsharded_param\")}\n"
                  "                output = torch.utils._pytree.tree_map_only(\n"
                  "                    torch.Tensor, lambda t: t.clone() if t.untyped_storage().data_ptr() in _held else t,\n"
                  "                    output)\n"
                  "                self.reshard()\n"),)),),
          older=(Edit("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup.post_forward",
                      (("                if not is_bw():\n                    self.reshard()\n",
                        "                if not is_bw():\n"
                        "                    _held = {fp._unsharded_param.untyped_storage().data_ptr()\n"
                        "                             for fp in self.fsdp_params if hasattr(fp, \"_unsharded_param\")}\n"
                        "                    output = torch.utils._pytree.tree_map_only(\n"
                        "                        torch.Tensor,\n"
                        "                        lambda t: t.clone() if t.untyped_storage().data_ptr() in _held else t,\n"
                        "                        output)\n"
                        "                    self.reshard()\n"),)),)),
    Probe("dtensor-conv-redistribute-first",
          "DTensor's convolution handlers (forward and backward) redistribute the local arguments as sharding "
          "propagation decided, as every other op's dispatch does, before they run the local convolution; the "
          "backward reduces a Partial input first, as the forward's propagation did, instead of sending the grad "
          "output to a Partial placement",
          custom=lambda: _together(_registered_swapped(_CONV_HANDLER, _dtensor_handlers, _aten("convolution.default")),
                                   _registered_swapped(_CONV_BACKWARD_HANDLER, _dtensor_handlers,
                                                       _aten("convolution_backward.default")))),
    Probe("graphed-clone-static-grads",
          "make_graphed_callables' backward hands out clones of its static grad buffers instead of detached "
          "aliases, so no .grad AccumulateGrad adopts is one the next replay overwrites",
          (Edit("torch.cuda.graphs", "make_graphed_callables",
                (("b.detach() if b is not None else b", "b.detach().clone() if b is not None else b"),)),)),
    Probe("graphed-non-differentiable-outputs",
          "make_graphed_callables' autograd.Function marks the static outputs that needed no grad at capture "
          "non-differentiable, so they come back needing none, as in eager",
          (Edit("torch.cuda.graphs", "make_graphed_callables",
                (("return tuple(o.detach() for o in static_outputs)\n",
                  "outs = tuple(o.detach() for o in static_outputs)\n"
                  "                ctx.mark_non_differentiable(*[d for d, o in zip(outs, static_outputs) if not o.requires_grad])\n"
                  "                return outs\n"),)),)),
    Probe("graphed-wire-params-with-grads",
          "make_graphed_callables hands its autograd.Function detached copies of the parameters that got no grad "
          "at capture, so autograd never reaches (nor runs the hooks of) a parameter the callable does not use",
          (Edit("torch.cuda.graphs", "make_graphed_callables",
                (("out = Graphed.apply(*(tuple(flatten_user_args) + module_params))",
                  "out = Graphed.apply(*(tuple(flatten_user_args) + tuple(\n"
                  "                p if g is not None else p.detach()\n"
                  "                for p, g in zip(module_params, static_grad_inputs[len_user_args:]))))"),)),)),
    Probe("split-grad-like-param",
          "stage_backward_weight lays a weight grad it adopts out like the weight (as AccumulateGrad does) when "
          "autograd computed it with other strides (an expanded grad too, whose adoption is "
          "split-adopts-aliased-grad's: where a case shows both, the probe cannot tell them apart)",
          _GRAD_LIKE_PARAM, older=_before_the_try(_GRAD_LIKE_PARAM)),
)}


def available(name: str) -> str | None:
    """None when probe ``name`` can be applied to the torch here, else why not."""
    probe = PROBES[name]
    try:
        if probe.custom is not None:
            with probe.custom():  # patches and restores at once: whatever it looks for is there
                pass
        probe.applicable()
    except (Unavailable, ImportError, AttributeError, OSError, TypeError, KeyError) as e:
        return str(e)
    return None


def patch(name: str) -> ContextManager[None]:
    """Probe ``name`` in force for what runs inside (Unavailable where it cannot be applied)."""
    return PROBES[name].patch()


def stackable(a: str, b: str) -> bool:
    """Whether probes ``a`` and ``b`` can be in force together: two that
    rewrite one function cannot (the second copy, made from torch's source,
    would replace the first's edit instead of adding to it)."""
    return not (PROBES[a].functions() & PROBES[b].functions())
