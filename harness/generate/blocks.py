"""Blocks: a case is a short list of small tuples ("block", weight slot,
variant) that ``interpret`` turns into SSA nodes by plain Python, so
Hypothesis shrinks a list (fewer blocks, lower slots: more tying) rather
than a graph.

The blocks are the patterns the seeds share: one weight at several sites
(nested and in parallel branches), transposed uses, tied input/output
projections, gains and biases that are parameters between tied uses,
multi-output nodes, custom backwards with odd grad layouts, parameters
combined before use, parameters shaped like the activations they meet,
inputs without grad, view outputs, hooks and ``retain_grad``.
"""

from __future__ import annotations

from harness.case import opinfo
from harness.case.ops import LAYOUTS
from harness.case.spec import Case, Hook, Input, Schedule, Use
from harness.generate.builder import _Builder
from harness.generate.model import MODEL_BUILDERS

BLOCKS = (
    "linear",  # h @ w
    "linear_t",  # h @ w.T
    "gain",  # h * g, g shaped (D,) or like h
    "bias",  # h + b
    "branch",  # h @ w + h @ w' (w' may be w, or w.T)
    "layout",  # LayoutMatmul(h, w) with a non-contiguous or offset grad
    "pair",  # Pair(h, h * g) -> pick or combine results
    "chunk",  # split h on the feature dim, recombine
    "combined",  # h @ (w1 * w2) or h @ stack([w1, w2]).sum(0)
    "reshape",  # h through a reshape round trip (views)
    "nonlin",  # relu (exact) or tanh (tolerance mode)
    "mix_input",  # h + x2 or h * x2, x2 an input without grad
    "project",  # out projection tied to an in projection: h @ P, ..., h @ P.T
    "hook",  # a tensor hook (scale or observe) on h
    "retain",  # retain_grad on h
    "passthrough",  # a grad handed on untouched: PassThrough(h), or h + b with b shaped like h
)
# Blocks a family may ask for (``Draw.blocks``); the founding draws never build them.
OPTIONAL_BLOCKS = (
    "dropout",  # dropout from the global RNG: recomputation must restore it
    "inplace",  # relu_ or mul_ by a gain, in place on a fresh copy
)
# An op of torch's OpInfo database on h (``harness.case.opinfo``): drawn by
# every target, with its own variant range (one number per op and sample).
OPINFO_BLOCK = "opinfo"
# Model parts (``cases(model=True)``, paths whose contract asks): the pieces
# transformers are made of, each a block that keeps h's shape, so they mix
# with every founding block and shrink the same way.
MODEL_BLOCKS = (
    "embed",  # h + embedding(E, idx), E (D + 1, D), maybe with a padding_idx
    "head",  # logits = h @ E.T (the embedding tied to the output head), back through E; maybe a cross-entropy loss
    "norm",  # layer_norm / rms_norm with a learned gain (tied across blocks by slot)
    "attention",  # pre-norm attention: h + sdpa(a @ Wq, a @ Wk, a @ Wv) @ Wo, weights tied by slot
    "mlp",  # gated MLP: h + ((h @ W1) * silu|gelu(h @ W2)) @ W1.T or W3
    "index",  # index_select, gather, scatter_add, index_add on h
    "expand",  # h * g.expand(B, D), g (1, D)
    "dropout", "inplace",
)

# Each block extends the chain at ``h`` and returns the new head; a block
# whose growth would break the magnitude budget (``b.grows``) leaves ``h`` as
# it is. One builder per block name: adding a block touches one function and
# one table row.


def _linear(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if not b.grows(3.0 * b.dim):
        return h
    w = b.param((b.dim, b.dim), slot)
    return b.node("matmul", Use(h), Use(w, transpose=block == "linear_t"))


def _gain(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if not b.grows(3.0):
        return h
    g = b.param((b.dim,) if variant % 2 == 0 else (b.batch, b.dim), slot, prefix="g")
    return b.node("mul", Use(h), Use(g)) if variant < 2 else b.node("mul", Use(g), Use(h))


def _bias(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if not b.grows(1.0):
        return h
    bias = b.param((b.dim,) if variant % 2 == 0 else (b.batch, b.dim), slot, prefix="b")
    b.bound += 3.0
    return b.node("add", Use(h), Use(bias))


def _branch(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    D = b.dim
    if not b.grows(2 * 3.0 * D):
        return h
    w = b.param((D, D), slot)
    other = w if variant % 3 != 2 else b.param((D, D), slot + 1)
    left = b.node("matmul", Use(h), Use(w))
    right = b.node("matmul", Use(h), Use(other, transpose=variant % 3 == 1))
    return b.node("add", Use(left), Use(right))


def _layout(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if not b.grows(3.0 * b.dim):
        return h
    w = b.param((b.dim, b.dim), slot)
    return b.node("layout_matmul", Use(h), Use(w), layout=LAYOUTS[variant % len(LAYOUTS)])


def _pair(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if not b.grows(9.0 * b.bound):
        return h
    g = b.param((b.batch, b.dim), slot, prefix="g")
    other = b.node("mul", Use(h), Use(g)) if variant % 2 else g
    pair = b.node("pair", Use(h), Use(other))
    if variant < 2:
        return b.node("add", Use(pair, index=0), Use(pair, index=1))
    return b.node("mul", Use(pair, index=variant % 2), Use(h))


def _chunk(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if b.dim % 2 != 0 or not b.grows(b.bound):
        return h
    c = b.node("chunk", Use(h), chunks=2, dim=1)
    if variant % 2:
        return b.node("cat", Use(c, index=1), Use(c, index=0), dim=1)
    s = b.node("mul", Use(c, index=0), Use(c, index=1))
    return b.node("cat", Use(s), Use(c, index=1), dim=1)


def _combined(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    D = b.dim
    if not b.grows(3.0 * D * 3.0):
        return h
    w1 = b.param((D, D), slot)
    w2 = b.param((D, D), slot + 1)
    if variant % 2:
        comb = b.node("mul", Use(w1), Use(w2, transpose=variant % 4 == 3))
    else:
        st_ = b.node("stack", Use(w1), Use(w2), dim=0)
        comb = b.node("sum", Use(st_), dim=0)
    return b.node("matmul", Use(h), Use(comb))


def _reshape(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if not b.grows(1.0):
        return h
    r = b.node("reshape", Use(h), shape=(b.dim, b.batch) if variant % 2 else (b.batch * b.dim,))
    return b.node("reshape", Use(r), shape=(b.batch, b.dim))


def _nonlin(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if not b.grows(1.0):
        return h
    return b.node("relu" if b.exact or variant % 2 else "tanh", Use(h))


def _mix_input(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if not b.grows(3.0):
        return h
    x2 = next((x.name for x in b.inputs if not x.requires_grad), None)
    if x2 is None:
        x2 = f"x{len(b.inputs)}"
        b.inputs.append(Input(x2, (b.batch, b.dim), requires_grad=False))
    b.bound += 3.0
    return b.node("add" if variant % 2 else "mul", Use(h), Use(x2))


def _project(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    # Tied in/out projection between two widths: h @ P (D->B), h @ P.T back.
    D, B = b.dim, b.batch
    mm = 3.0 * D
    if D == B or not b.grows(mm * mm):
        return h
    p = b.param((D, B), slot, prefix="p")
    mid = b.node("matmul", Use(h), Use(p))
    if variant % 2:
        mid = b.node("relu", Use(mid))
    return b.node("matmul", Use(mid), Use(p, transpose=True))


def _hook(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if not h.startswith("n") or any(k.node == h for k in b.hooks):
        return h
    if b.exact or variant < 2:
        factor = (2, -1, 1)[variant % 3]
        b.hooks.append(Hook(h, "scale" if factor != 1 else "observe", factor))
        b.grows(2.0)
    else:
        b.hooks.append(Hook(h, "observe", 1))
    return h


def _retain(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if h.startswith("n") and h not in b.retain:
        b.retain.append(h)
    return h


def _passthrough(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    # The caller's grad output reaches a parameter's grad unchanged (no op
    # between rescales or copies it): where an implementation that adopts
    # autograd's tensor as .grad aliases the user's buffer.
    if variant % 2 == 0:
        h = b.node("passthrough", Use(h))
    if variant >= 1:
        if not b.grows(1.0):
            return h
        bias = b.param((b.batch, b.dim), slot, prefix="b")
        b.bound += 3.0
        h = b.node("add", Use(h), Use(bias))
    return h


def _dropout(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    """The harness's own dropout, or (variants 1 to 3, tolerance mode) a
    random op of torch's OpInfo database: both draw from the global RNG."""
    pool = opinfo.random_draws()
    if variant == 0 or b.exact or not pool:
        return b.node("dropout", Use(h)) if b.grows(2.0) else h
    key, i = pool[(slot * 3 + variant - 1) % len(pool)]
    return b.node("opinfo", Use(h), fn=key, call=opinfo.table()[key]["samples"][i])


def _inplace(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if variant % 2 == 0:
        return b.node("relu_", Use(h)) if b.grows(1.0) else h
    if variant == 3:  # add_ of a bias, in place on the activation
        if not b.grows(1.0):
            return h
        b.bound += 3.0
        return b.node("add_", Use(h), Use(b.param((b.dim,), slot, prefix="b")))
    if not b.grows(3.0):
        return h
    g = b.param((b.dim,) if variant == 1 else (b.batch, b.dim), slot, prefix="g")
    return b.node("mul_", Use(h), Use(g))


# The OpInfo pool, built once per op table: ``opinfo.draws`` walks the whole
# table on every call, which cost a millisecond per opinfo block drawn.
_POOL: list = [None, ()]


def _opinfo_pool() -> tuple[tuple[str, int], ...]:
    table = opinfo.table()
    if _POOL[0] is not table:
        _POOL[:] = [table, opinfo.draws()]
    return _POOL[1]


def _opinfo(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    # An op of torch's OpInfo database (tolerance mode: its values are not integers).
    pool = _opinfo_pool()
    if b.exact or not pool:
        return h
    key, i = pool[variant % len(pool)]
    return b.node("opinfo", Use(h), fn=key, call=opinfo.table()[key]["samples"][i])


BUILDERS = {
    "linear": _linear, "linear_t": _linear, "gain": _gain, "bias": _bias, "branch": _branch, "layout": _layout,
    "pair": _pair, "chunk": _chunk, "combined": _combined, "reshape": _reshape, "nonlin": _nonlin,
    "mix_input": _mix_input, "project": _project, "hook": _hook, "retain": _retain, "passthrough": _passthrough,
    "dropout": _dropout, "inplace": _inplace, "opinfo": _opinfo, **MODEL_BUILDERS,
}


def _apply(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    build = BUILDERS.get(block)
    return h if build is None else build(b, h, block, slot, variant)


def interpret(
    blocks: list[tuple[str, int, int]],
    *,
    dim: int,
    batch: int,
    x_grad: bool,
    exact: bool,
    out_kind: int,
    schedule: Schedule,
    seed: int,
) -> Case:
    b = _Builder(dim=dim, batch=batch, exact=exact)
    b.inputs.append(Input("x0", (batch, dim), requires_grad=x_grad))
    h = "x0"
    history = []
    for block, slot, variant in blocks:
        h = _apply(b, h, block, slot, variant)
        history.append(h)
    if not b.params:
        w = b.param((dim, dim), 0)
        h = b.node("matmul", Use(h), Use(w))
        history.append(h)
    if h == "x0":
        h = b.node("mul", Use(h), Use(b.params[0].name)) if b.params[0].shape in ((dim,), (batch, dim)) else b.node(
            "matmul", Use(h), Use(b.param((dim, dim), 0)))
    outputs = [Use(h)]
    earlier = [n for n in history if n.startswith("n") and n != h and n not in {c.name for c in b.nodes if c.op in ("chunk", "pair")}]
    if out_kind == 1:
        outputs = [Use(h, transpose=True)]  # a view as output
    elif out_kind == 2 and earlier:
        outputs.append(Use(earlier[len(earlier) // 2]))  # one output computed from another
    elif out_kind == 3:
        outputs = [Use(b.node("sum", Use(h), dim=0))]
    elif out_kind == 4 and not exact:
        outputs = [Use(b.node("mean", Use(h), dim=None))]
    outputs += [Use(loss) for loss in b.losses]  # a model's scalar loss beside its output
    return Case(
        params=tuple(b.params),
        inputs=tuple(b.inputs),
        nodes=tuple(b.nodes),
        outputs=tuple(outputs),
        schedule=schedule,
        hooks=tuple(b.hooks),
        retain_grad=tuple(b.retain),
        dtype="float32",
        exact=exact,
        seed=seed,
    )

