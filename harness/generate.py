"""Hypothesis strategies for cases that favour the founding patterns.

Drawing is cheap by design: a case is a short list of small tuples
("block", weight slot, variant) interpreted by plain Python into SSA nodes.
Hypothesis shrinks the list (fewer blocks, lower slots: more tying), so a
failure shrinks towards ``x @ w0 @ w0``-sized modules.

The blocks are the patterns the seeds share: one weight at several sites
(nested and in parallel branches), transposed uses, tied input/output
projections, gains and biases that are parameters between tied uses,
multi-output nodes, custom backwards with odd grad layouts, parameters
combined before use, parameters shaped like the activations they meet,
inputs without grad, view outputs, hooks and ``retain_grad``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from hypothesis import strategies as st

from harness.case.ops import LAYOUTS
from harness.case.spec import PARAM_HOOKS, Case, Event, Hook, Input, Node, Param, Schedule, Use

@dataclass(frozen=True)
class Draw:
    """A family's own knobs, drawn after the core case (stage cuts, regions,
    wrapper switches): each of ``steps``, called as ``step(case, *args)``, is
    a strategy of the case with some set, drawn in turn. ``blocks`` are extra
    block kinds the family wants in the core case (they come only to its
    paths, so other paths' case distributions, and their saved examples, stay
    as they were). Two contracts with equal draws share one case stream."""

    name: str
    steps: tuple[Callable[..., Any], ...] = field(compare=False, repr=False)
    args: tuple = ()
    blocks: tuple[str, ...] = ()


# --mode: which data a session draws (None: both, case by case).
MODES: dict[str, bool | None] = {"exact": True, "tolerance": False, "both": None}

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
# Pressure allocations: the CUDA caching allocator's small blocks (512 B
# granules in 2 MiB segments) and large ones, so freed graph-surface memory
# gets handed to someone else.
PRESSURE_SIZES = (4, 6, 12, 128, 4096, 2**16, 2**18, 2**20)
EXACT_BUDGET = 2.0**16  # forward magnitude estimate; grads add batch, microbatch and cotangent factors


@dataclass
class _Builder:
    dim: int
    batch: int
    exact: bool
    params: list[Param] = field(default_factory=list)
    inputs: list[Input] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    hooks: list[Hook] = field(default_factory=list)
    retain: list[str] = field(default_factory=list)
    bound: float = 3.0
    losses: list[str] = field(default_factory=list)  # scalar losses (cross-entropy), extra outputs

    def param(self, shape: tuple[int, ...], slot: int, prefix: str = "w") -> str:
        """Slot picks an existing parameter of this shape (tying) or makes one."""
        same = [p.name for p in self.params if p.shape == shape]
        if slot < len(same):
            return same[slot]
        name = f"{prefix}{len(self.params)}"
        self.params.append(Param(name, shape))
        return name

    def node(self, op: str, *args: Use, **attrs) -> str:
        name = f"n{len(self.nodes)}"
        self.nodes.append(Node(name, op, tuple(args), tuple(sorted(attrs.items()))))
        return name

    def grows(self, factor: float) -> bool:
        """In exact mode, refuse a block that could leave the exact range."""
        if self.exact and self.bound * factor > EXACT_BUDGET:
            return False
        self.bound *= factor
        return True


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
    return b.node("dropout", Use(h)) if b.grows(2.0) else h


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


def _vocab(b: _Builder) -> int:
    return b.dim + 1  # unlike any (D, D) weight, so an embedding ties only with embeddings


def _embed(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if not b.grows(1.0):
        return h
    V = _vocab(b)
    e = b.param((V, b.dim), slot, prefix="e")
    idx = tuple((variant + 2 * i + slot) % V for i in range(b.batch))
    pad = {"padding_idx": idx[0]} if variant == 3 else {}
    b.bound += 3.0
    return b.node("add", Use(h), Use(b.node("embedding", Use(e), idx=idx, **pad)))


def _head(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    D, V = b.dim, _vocab(b)
    if not b.grows(9.0 * D * V):
        return h
    e = b.param((V, D), slot, prefix="e")
    logits = b.node("matmul", Use(h), Use(e, transpose=True))
    if not b.exact and variant >= 2:
        b.losses.append(b.node("cross_entropy", Use(logits), target=tuple((slot + 3 * i) % V for i in range(b.batch))))
    if not b.exact:
        logits = b.node("softmax" if variant % 2 else "log_softmax", Use(logits))
    return b.node("matmul", Use(logits), Use(e))


def _norm_node(b: _Builder, h: str, slot: int, variant: int) -> str:
    g = b.param((b.dim,), slot, prefix="g")
    return b.node("rms_norm" if variant % 2 else "layer_norm", Use(h), Use(g))


def _norm(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    return h if b.exact else _norm_node(b, h, slot, variant)


def _attention(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if b.exact:
        return h
    D = b.dim
    a = _norm_node(b, h, slot, variant)
    wq, wk, wv = (b.param((D, D), slot + i) for i in range(3))
    q, k, v = (b.node("matmul", Use(a), Use(w)) for w in (wq, wk, wv))
    o = b.node("sdpa", Use(q), Use(k), Use(v), causal=int(variant >= 2))
    return b.node("add", Use(h), Use(b.node("matmul", Use(o), Use(b.param((D, D), slot)))))


def _mlp(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if b.exact:
        return h
    D = b.dim
    w1, w2 = b.param((D, D), slot), b.param((D, D), slot + 1)
    up = b.node("matmul", Use(h), Use(w1))
    gate = b.node("silu" if variant % 2 else "gelu", Use(b.node("matmul", Use(h), Use(w2))))
    down = Use(w1, transpose=True) if variant < 2 else Use(b.param((D, D), slot + 2))
    return b.node("add", Use(h), Use(b.node("matmul", Use(b.node("mul", Use(up), Use(gate))), down)))


def _index(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    B, D = b.batch, b.dim
    if variant == 0:
        return b.node("index_select", Use(h), dim=1, idx=tuple((slot + 3 * i) % D for i in range(D)))
    if variant == 1:
        return b.node("gather", Use(h), dim=1, seed=slot * 7 + 1)
    if not b.grows(float(B + 1)):
        return h
    if variant == 2:
        return b.node("scatter_add", Use(h), Use(h), dim=0, seed=slot * 7 + 2)
    return b.node("index_add", Use(h), Use(h), idx=tuple((slot + i) % B for i in range(B)))


def _expand(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if not b.grows(3.0):
        return h
    g = b.param((1, b.dim), slot, prefix="g")
    return b.node("mul", Use(h), Use(b.node("expand", Use(g), shape=(b.batch, b.dim))))


BUILDERS = {
    "linear": _linear, "linear_t": _linear, "gain": _gain, "bias": _bias, "branch": _branch, "layout": _layout,
    "pair": _pair, "chunk": _chunk, "combined": _combined, "reshape": _reshape, "nonlin": _nonlin,
    "mix_input": _mix_input, "project": _project, "hook": _hook, "retain": _retain, "passthrough": _passthrough,
    "dropout": _dropout, "inplace": _inplace, "embed": _embed, "head": _head, "norm": _norm,
    "attention": _attention, "mlp": _mlp, "index": _index, "expand": _expand,
}


def _apply(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    build = BUILDERS.get(block)
    return h if build is None else build(b, h, block, slot, variant)


class _Drawn:
    """The strategies ``cases`` draws from, made once per size limit (same
    draws, same shrinking, as building them inline)."""

    _made: dict[tuple[int, int, bool, tuple[str, ...], bool, bool], "_Drawn"] = {}

    def __init__(self, max_blocks: int, max_microbatches: int, gaps: bool = False, extra: tuple[str, ...] = (),
                 model: bool = False, random_ops: bool = True) -> None:
        self.exact = st.booleans().map(lambda b: not b)
        self.dim = st.sampled_from((3, 2, 4))
        # Microbatch size 1 (gap cases): every batch-shaped grad is then a
        # pass-through candidate, and size-1 dims admit any stride.
        self.batch = st.sampled_from((2, 3, 1) if gaps else (2, 3))
        self.x_grad = st.sampled_from((True, False))
        # Gap cases pull harder towards pass-through grads (3 in 18 blocks).
        blocks = BLOCKS + ("passthrough",) * 2 if gaps else BLOCKS
        blocks += extra
        blocks += tuple(m for m in MODEL_BLOCKS if m not in blocks) if model else ()
        if not random_ops:  # paths that cannot reproduce a seeded mask: not drawn only to be refused
            blocks = tuple(b for b in blocks if b != "dropout")
        self.blocks = st.lists(st.tuples(st.sampled_from(blocks), st.integers(0, 2), st.integers(0, 3)),
                               min_size=1, max_size=max_blocks)
        self.out_kind = st.integers(0, 4)
        self.microbatches = st.integers(1, max_microbatches)
        self.steps = st.integers(1, 2)
        self.grad_init = st.sampled_from(("none", "zero", "prefilled"))
        self.zero_grad = st.sampled_from(("set_to_none", "zeros", "keep"))
        self.seed = st.integers(0, 2**16)

    @classmethod
    def get(cls, max_blocks: int, max_microbatches: int, gaps: bool = False, extra: tuple[str, ...] = (),
            model: bool = False, random_ops: bool = True) -> "_Drawn":
        key = (max_blocks, max_microbatches, gaps, extra, model, random_ops)
        if key not in cls._made:
            cls._made[key] = cls(*key)
        return cls._made[key]


@st.composite
def cases(draw, exact: bool | None = None, max_blocks: int = 6, max_microbatches: int = 4,
          lifetime: bool = False, gaps: bool = False, model: bool = False, input_grad: bool = False,
          random_ops: bool = True, draws: tuple[Draw, ...] = ()) -> Case:
    """Valid cases; ``exact`` None draws the mode too. ``lifetime`` also draws
    buffer-lifetime schedules (allocator pressure between backwards, held
    outputs, parameter hooks); ``draws`` are the families' own knobs, drawn
    last and in order, so cases drawn without them are unchanged."""
    # The strategies are built once (_Drawn), not per draw: building and
    # validating them again for every case cost a third of generation.
    extra = tuple(dict.fromkeys(b for d in draws for b in d.blocks))
    s = _Drawn.get(max_blocks, max_microbatches, gaps, extra, model, random_ops)
    if exact is None:
        exact = draw(s.exact)  # shrinks towards exact mode
    dim = draw(s.dim)
    batch = draw(s.batch)
    x_grad = True if input_grad else draw(s.x_grad)
    blocks = draw(s.blocks)
    out_kind = draw(s.out_kind)
    schedule = Schedule(
        microbatches=draw(s.microbatches),
        steps=draw(s.steps),
        grad_init=draw(s.grad_init),
        zero_grad=draw(s.zero_grad),
    )
    seed = draw(s.seed)
    if lifetime:
        schedule = draw(lifetime_schedules(schedule))
    case = interpret(blocks, dim=dim, batch=batch, x_grad=x_grad, exact=exact,
                     out_kind=out_kind, schedule=schedule, seed=seed)
    if gaps:
        case = draw(gap_cases(case))
    for d in draws:
        for step in d.steps:
            case = draw(step(case, *d.args))
    return case


@st.composite
def gap_cases(draw, case: Case) -> Case:
    """What real training has and the founding blocks never build: frozen
    parameters beside trainable ones (fine-tuning, LoRA), a parameter that
    never reaches the outputs, an input that requires grad and reaches none,
    inputs that need no grad before the ones that do, an output that needs no
    grad beside ones that do, and a last stage's scalar loss. Each is one draw that shrinks to "not there"."""
    frozen = draw(st.lists(st.integers(0, 4), min_size=len(case.params), max_size=len(case.params)))
    params = [replace(p, requires_grad=False) if f == 4 else p for p, f in zip(case.params, frozen)]
    if draw(st.integers(0, 3)) == 3:
        params.append(Param(f"u{len(params)}", params[0].shape))  # unused: no node reads it
    inputs, nodes, outputs = list(case.inputs), list(case.nodes), list(case.outputs)
    no_grad_out = draw(st.integers(0, 3))  # 1: appended, 2: first
    if no_grad_out in (1, 2):
        x = next((i.name for i in inputs if not i.requires_grad), None)
        if x is None:
            x = f"x{len(inputs)}"
            inputs.append(Input(x, inputs[0].shape, requires_grad=False))
        nodes.append(Node(f"n{len(nodes)}", "relu", (Use(x),)))
        use = Use(nodes[-1].name)
        outputs = outputs + [use] if no_grad_out == 1 else [use] + outputs
    if draw(st.integers(0, 4)) == 4:  # an input that requires grad and reaches no output
        inputs.append(Input(f"x{len(inputs)}", inputs[0].shape, requires_grad=True))
    if draw(st.integers(0, 2)) == 2:  # inputs that need no grad first
        inputs = sorted(inputs, key=lambda i: i.requires_grad)
    loss = draw(st.integers(0, 3)) == 3
    return replace(case, params=tuple(params), inputs=tuple(inputs), nodes=tuple(nodes),
                   outputs=tuple(outputs), loss=loss)


@st.composite
def training_steps(draw, case: Case) -> Case:
    """Past backward, where a DTensor grad is used: clip_grad_norm_ (a norm
    type) and an optimizer step (an implementation) after each step's last
    microbatch. Such cases run in float64, where optimizer arithmetic can be
    held to a tight relative tolerance. Shrinks to no training step."""
    from harness.case.training import CLIP_NORMS, FUSED, OPTIMIZERS, SIGN_BASED

    if not draw(st.booleans()):
        return case
    clip = draw(st.sampled_from(("",) + CLIP_NORMS))
    names = [n for n in OPTIMIZERS if case.exact or n not in SIGN_BASED]
    optimizer = draw(st.sampled_from(["", *names]))
    impls = ("", "for_loop", "foreach") + (("fused",) if optimizer in FUSED else ())
    impl = draw(st.sampled_from(impls)) if optimizer else ""
    if not clip and not optimizer:
        return case
    schedule = replace(case.schedule, clip=clip, max_norm=draw(st.sampled_from((1.0, 10.0))),
                       optimizer=optimizer, optimizer_impl=impl, lr=draw(st.sampled_from((0.1, 0.01))))
    return replace(case, schedule=schedule, dtype="float64")


@st.composite
def dtensor_placements(draw, case: Case) -> Case:
    """Where each parameter lives on the mesh: all through ``to_local`` with
    Partial grads (the seed's pattern, what this shrinks to), or each one a
    Replicate or Shard(d) DTensor used as one, or (a weight used only as
    ``h @ w``) a tensor-parallel style."""
    if not draw(st.booleans()):
        return case
    params = tuple(
        replace(p, placement=draw(st.sampled_from(
            ("replicate",) + tuple(f"shard{d}" for d in range(len(p.shape)))
            + (("colwise", "rowwise") if tp_eligible(case, p.name) else ()))))
        for p in case.params
    )
    return replace(case, params=params)


def tp_eligible(case: Case, name: str) -> bool:
    """Can ``name`` run as an nn.Linear under a tensor-parallel style? Only
    when every use is the plain right operand of a matmul (``h @ w``)."""
    uses = [(node, i, u) for node in case.nodes for i, u in enumerate(node.args) if u.ref == name]
    return bool(uses) and all(node.op == "matmul" and i == 1 and not u.transpose for node, i, u in uses) \
        and not any(u.ref == name for u in case.outputs)


@st.composite
def lifetime_schedules(draw, schedule: Schedule) -> Schedule:
    """``schedule`` plus events between its backwards, held outputs and hooks.

    Everything shrinks away (no events, nothing held, no hooks), so a
    failure that does not need them is reported without them.
    """
    between = schedule.backwards - 1
    events: list[Event] = []
    if between > 0:
        for after, kind, sizes in draw(st.lists(
            st.tuples(st.integers(0, between - 1), st.sampled_from(("alloc", "empty_cache", "free")),
                      st.lists(st.sampled_from(PRESSURE_SIZES), min_size=1, max_size=3)),
            max_size=4,
        )):
            events.append(Event(after, kind, tuple(sizes) if kind == "alloc" else ()))
    events.sort(key=lambda e: e.after)
    retain_outputs = draw(st.integers(0, 3)) == 3
    hooks = draw(st.lists(st.sampled_from(PARAM_HOOKS), unique=True, max_size=2))
    return replace(schedule, events=tuple(events), retain_outputs=retain_outputs, param_hooks=tuple(hooks))


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


# Parameter placements on a mesh, then maybe a training step: the DTensor and compile paths.
PLACEMENTS = Draw("placements", (dtensor_placements, training_steps))
