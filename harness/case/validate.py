"""Validation of a Case: every error names the field it is about.

Beyond shapes, what a case builds is bounded here, from shapes alone,
before any tensor exists: each tensor at most ``MAX_NUMEL`` elements, each
forward at most ``budget.MAX_TENSORS`` tensor objects (counted before a
node's results are even listed), and the whole case by ``budget.check``.
"""

from __future__ import annotations

from typing import Any

from harness.case import budget
from harness.case.ops import OPS, Result, Shape, ShapeError
from harness.case.schema import ascii_int
from harness.case.vocab import DTYPES, EVENT_KINDS, EVENT_MAX_ELEMENTS, GRAD_INITS, HOOK_KINDS, PARAM_HOOKS, ZERO_GRADS, SpecError

# The case under check (``harness.case.spec.Case``) is typed Any: the spec
# imports this module to check every case it decodes, so this module does
# not import the spec, not even for annotations.


def _use_shape(use: Any, known: dict[str, Result], where: str) -> Shape:
    if use.ref not in known:
        raise SpecError(f"{where}.ref", f"{use.ref!r} names no parameter, input or earlier node")
    shape = known[use.ref]
    multi = bool(shape) and isinstance(shape[0], tuple)
    if multi:
        if use.index is None:
            raise SpecError(f"{where}.index", f"{use.ref!r} has {len(shape)} results; pick one with index")
        if not 0 <= use.index < len(shape):
            raise SpecError(f"{where}.index", f"{use.ref!r} has no result {use.index} (it has {len(shape)})")
        shape = shape[use.index]
    elif use.index is not None:
        raise SpecError(f"{where}.index", f"{use.ref!r} has a single result; index must be null")
    if use.transpose:
        if len(shape) < 2:
            raise SpecError(f"{where}.transpose", f"{use.ref!r} has shape {shape}: nothing to transpose")
        shape = shape[:-2] + (shape[-1], shape[-2])
    return shape  # type: ignore[return-value]


MAX_NUMEL = 2**22  # elements in one tensor
EVENTS_MAX_ELEMENTS = 2**24  # all alloc events of a schedule together

# The attributes each op takes, and their type: "int", "int?" (or null), "shape", "layout".
OP_ATTRS: dict[str, dict[str, str]] = {
    "reshape": {"shape": "shape"}, "sum": {"dim": "int?"}, "mean": {"dim": "int?"},
    "layout_matmul": {"layout": "layout"}, "chunk": {"chunks": "int", "dim": "int"},
    "cat": {"dim": "int"}, "stack": {"dim": "int"},
    # Model parts: integer indices are plain data in the case (no integer inputs).
    "embedding": {"idx": "index", "padding_idx": "int?"}, "cross_entropy": {"target": "index"},
    "sdpa": {"causal": "int"}, "expand": {"shape": "shape"}, "index_select": {"dim": "int", "idx": "index"},
    "gather": {"dim": "int", "seed": "int"}, "scatter_add": {"dim": "int", "seed": "int"},
    "index_add": {"idx": "index"},
    # fn and call decoded and checked by harness.case.opinfo; place: the input's Shard dim under DTensor
    "opinfo": {"fn": "fn", "call": "call", "place": "int?"},
}


def _check_attrs(op: str, attrs: tuple, where: str) -> None:
    from harness.case.ops import LAYOUTS

    allowed = OP_ATTRS.get(op, {})
    seen = set()
    for j, (key, value) in enumerate(attrs):
        w = f"{where}.attrs[{j}]"
        if key not in allowed:
            raise SpecError(w, f"{op} takes no attribute {key!r}" + (f"; it takes {', '.join(allowed)}" if allowed else ""))
        if key in seen:
            raise SpecError(w, f"attribute {key!r} given twice")
        seen.add(key)
        want = allowed[key]
        ok = {"int": isinstance(value, int) and not isinstance(value, bool),
              "int?": value is None or isinstance(value, int) and not isinstance(value, bool),
              "shape": isinstance(value, tuple) and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value),
              "index": isinstance(value, tuple) and len(value) > 0
              and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value),
              "layout": value in LAYOUTS, "fn": isinstance(value, str), "call": isinstance(value, tuple)}[want]
        if not ok:
            raise SpecError(w, f"{op} attribute {key!r} must be "
                               + {"int": "an integer", "int?": "an integer or null", "shape": "a list of positive integers",
                                  "index": "a non-empty list of non-negative integers",
                                  "layout": f"one of {LAYOUTS}", "fn": "an op table key",
                                  "call": "a call value"}[want] + f", got {value!r}")


def _numel(shape: Result) -> int:
    return budget.numel(shape)


def check_budget(case: Any, known: dict[str, Result]) -> int:
    """Bytes the case builds (``harness.case.budget``); a SpecError above a limit."""
    events = sum(sum(e.sizes) for e in case.schedule.events)
    if events > EVENTS_MAX_ELEMENTS:
        raise SpecError("schedule.events", f"alloc events hold {events} elements together; at most {EVENTS_MAX_ELEMENTS}")
    return budget.check(case, known)


def _results(node: Any, op: Any, where: str, made: int) -> int:
    """Tensor objects a node makes, refused before they are listed (a chunk
    count of a million would build a million shapes just to be counted)."""
    n = op.outputs if op.outputs >= 0 else dict(node.attrs).get("chunks", 2)
    if isinstance(n, int) and made + n > budget.MAX_TENSORS:
        raise SpecError(f"{where}.attrs", f"{node.op} makes {n} tensors, {made + n} in the forward so far; "
                                          f"a case may make {budget.MAX_TENSORS}")
    return n if isinstance(n, int) else 1


def infer_shapes(case: Any) -> dict[str, Result]:
    """Shapes of every named value; raises SpecError on the first problem."""
    if case.dtype not in DTYPES:
        raise SpecError("dtype", f"unknown dtype {case.dtype!r}; one of {DTYPES}")
    _check_schedule(case.schedule)
    known: dict[str, Result] = {}

    def declare(name: str, shape: Result, where: str, field: str = "shape") -> None:
        if not isinstance(name, str) or not name.isidentifier():
            raise SpecError(f"{where}.name", f"{name!r} is not a valid identifier")
        if name in known:
            raise SpecError(f"{where}.name", f"{name!r} is defined twice")
        if _numel(shape) > MAX_NUMEL:
            raise SpecError(f"{where}.{field}" if field else where,
                            f"{name!r} has {_numel(shape)} elements ({shape}); at most {MAX_NUMEL} in one tensor")
        known[name] = shape

    for i, p in enumerate(case.params):
        declare(p.name, p.shape, f"params[{i}]")
        _check_placement(p.placement, len(p.shape), f"params[{i}].placement")
    for i, x in enumerate(case.inputs):
        declare(x.name, x.shape, f"inputs[{i}]")
    made = len(case.params) + len(case.inputs)
    for i, node in enumerate(case.nodes):
        where = f"nodes[{i}]"
        op = OPS.get(node.op)
        if op is None:
            raise SpecError(f"{where}.op", f"unknown op {node.op!r}; known ops: {', '.join(sorted(OPS))}")
        if not op.min_args <= len(node.args) <= op.max_args:
            raise SpecError(f"{where}.args", f"{node.op} takes {op.min_args}..{op.max_args} operands, got {len(node.args)}")
        shapes = [_use_shape(u, known, f"{where}.args[{j}]") for j, u in enumerate(node.args)]
        _check_attrs(node.op, node.attrs, where)
        made += _results(node, op, where, made)
        try:
            result = op.shape(shapes, dict(node.attrs))
        except ShapeError as e:
            raise SpecError(where, f"{node.op}: {e}") from None
        if case.exact and not op.exact:
            raise SpecError(f"{where}.op", f"{node.op} is not exact; use it only with exact=false")
        declare(node.name, result, where, "")
    if not case.outputs:
        raise SpecError("outputs", "a case needs at least one output")
    for i, u in enumerate(case.outputs):
        _use_shape(u, known, f"outputs[{i}]")
    nodes = {n.name for n in case.nodes}
    for i, h in enumerate(case.hooks):
        if h.node not in nodes or isinstance(known[h.node][0] if known[h.node] else None, tuple):
            raise SpecError(f"hooks[{i}].node", f"{h.node!r} is not a single-result node")
        if h.kind not in HOOK_KINDS:
            raise SpecError(f"hooks[{i}].kind", f"unknown {h.kind!r}; one of {HOOK_KINDS}")
    for i, name in enumerate(case.retain_grad):
        if name not in nodes or isinstance(known[name][0] if known[name] else None, tuple):
            raise SpecError(f"retain_grad[{i}]", f"{name!r} is not a single-result node")
    check_budget(case, known)
    return known


def _check_schedule(s) -> None:
    """The loop around the module: every microbatch and step runs the whole
    case again, so their counts are bounded."""
    if not (isinstance(s.microbatches, int) and 1 <= s.microbatches <= 16):
        raise SpecError("schedule.microbatches", f"expected 1..16, got {s.microbatches!r}")
    if not (isinstance(s.steps, int) and 1 <= s.steps <= 8):
        raise SpecError("schedule.steps", f"expected 1..8, got {s.steps!r}")
    if s.grad_init not in GRAD_INITS:
        raise SpecError("schedule.grad_init", f"unknown {s.grad_init!r}; one of {GRAD_INITS}")
    if s.zero_grad not in ZERO_GRADS:
        raise SpecError("schedule.zero_grad", f"unknown {s.zero_grad!r}; one of {ZERO_GRADS}")
    _check_lifetime(s)
    _check_training(s)


def _check_lifetime(s) -> None:
    """The optional buffer-lifetime parts of a schedule."""
    for i, e in enumerate(s.events):
        where = f"schedule.events[{i}]"
        if e.kind not in EVENT_KINDS:
            raise SpecError(f"{where}.kind", f"unknown {e.kind!r}; one of {EVENT_KINDS}")
        if not (isinstance(e.after, int) and 0 <= e.after < s.backwards - 1):
            raise SpecError(f"{where}.after", f"expected a backward between two others (0..{s.backwards - 2}), got {e.after!r}")
        if e.kind == "alloc" and not e.sizes:
            raise SpecError(f"{where}.sizes", "an alloc event needs at least one size")
        if sum(e.sizes) > EVENT_MAX_ELEMENTS:
            raise SpecError(f"{where}.sizes", f"more than {EVENT_MAX_ELEMENTS} elements in one event")
    if not isinstance(s.retain_outputs, bool):
        raise SpecError("schedule.retain_outputs", f"expected true or false, got {s.retain_outputs!r}")
    for i, h in enumerate(s.param_hooks):
        if h not in PARAM_HOOKS:
            raise SpecError(f"schedule.param_hooks[{i}]", f"unknown {h!r}; one of {PARAM_HOOKS}")
    if len(set(s.param_hooks)) != len(s.param_hooks):
        raise SpecError("schedule.param_hooks", "a hook kind is listed twice")


def _check_placement(placement: str, ndim: int, where: str) -> None:
    """A DTensor placement: "", "partial", "replicate", "shardD" with D a dim,
    or a tensor-parallel style ("colwise", "rowwise") for a 2-d weight."""
    if placement in ("", "partial", "replicate"):
        return
    if placement in ("colwise", "rowwise") and ndim == 2:
        return
    dim = ascii_int(placement[5:]) if placement.startswith("shard") else None
    if dim is not None and dim < ndim:
        return
    raise SpecError(where, f"unknown placement {placement!r}; one of partial, replicate, shard0..shard{ndim - 1}"
                           + (", colwise, rowwise" if ndim == 2 else ""))


def _check_training(s) -> None:
    """The optional training step of a schedule (clip_grad_norm_, optimizer)."""
    from harness.case.training import CLIP_NORMS, FUSED, OPTIMIZER_IMPLS, OPTIMIZERS

    if s.clip and s.clip not in CLIP_NORMS:
        raise SpecError("schedule.clip", f"unknown norm type {s.clip!r}; one of {CLIP_NORMS}")
    if not (isinstance(s.max_norm, (int, float)) and s.max_norm > 0):
        raise SpecError("schedule.max_norm", f"expected a positive number, got {s.max_norm!r}")
    if s.optimizer and s.optimizer not in OPTIMIZERS:
        raise SpecError("schedule.optimizer", f"unknown optimizer {s.optimizer!r}; one of {tuple(OPTIMIZERS)}")
    if s.optimizer_impl not in OPTIMIZER_IMPLS:
        raise SpecError("schedule.optimizer_impl", f"unknown {s.optimizer_impl!r}; one of {OPTIMIZER_IMPLS}")
    if s.optimizer_impl == "fused" and s.optimizer not in FUSED:
        raise SpecError("schedule.optimizer_impl", f"{s.optimizer or 'no optimizer'} has no fused implementation; fused: {sorted(FUSED)}")
    if s.optimizer_impl and not s.optimizer:
        raise SpecError("schedule.optimizer_impl", "an implementation needs an optimizer")
    if not (isinstance(s.lr, (int, float)) and s.lr > 0):
        raise SpecError("schedule.lr", f"expected a positive number, got {s.lr!r}")
