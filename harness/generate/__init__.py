"""Hypothesis strategies for cases that favour the founding patterns.

Drawing is cheap by design: a case is a short list of small tuples
("block", weight slot, variant) interpreted by plain Python into SSA nodes.
Hypothesis shrinks the list (fewer blocks, lower slots: more tying), so a
failure shrinks towards ``x @ w0 @ w0``-sized modules.

The blocks, and how a list of them becomes a ``Case``, are in ``blocks``
(``builder``: the case under construction; ``model``: the transformer
parts); the strategies drawn around the core case are in ``draws``.
"""

from __future__ import annotations

from typing import Callable

from hypothesis import strategies as st

from harness.case.spec import Case, Schedule
from harness.case import opinfo
from harness.generate.blocks import BLOCKS, BUILDERS, MODEL_BLOCKS, OPINFO_BLOCK, OPTIONAL_BLOCKS, interpret
from harness.generate.focus import MOSTLY, focus_blocks, focus_training, repair
from harness.generate.draws import ONE_IN_EIGHT, PLACEMENTS, Draw, data_variants, dtensor_placements, gap_cases, lifetime_schedules, tp_eligible, training_steps

__all__ = [
    "BLOCKS", "BUILDERS", "MODEL_BLOCKS", "MODES", "MOSTLY", "ONE_IN_EIGHT", "OPTIONAL_BLOCKS", "PLACEMENTS", "Draw", "cases",
    "data_variants", "repair",
    "dtensor_placements", "gap_cases", "interpret", "lifetime_schedules", "tp_eligible", "training_steps",
]

# --mode: which data a session draws (None: both, case by case).
MODES: dict[str, bool | None] = {"exact": True, "tolerance": False, "both": None}


class _Drawn:
    """The strategies ``cases`` draws from, made once per size limit (same
    draws, same shrinking, as building them inline)."""

    _made: dict[tuple[int, int, bool, tuple[str, ...], bool, bool, bool, bool, bool], "_Drawn"] = {}

    def __init__(self, max_blocks: int, max_microbatches: int, gaps: bool = False, extra: tuple[str, ...] = (),
                 model: bool = False, random_ops: bool = True, mostly_grad: bool = False,
                 retained_grads: bool = True, hooks: bool = True) -> None:
        self.exact = st.booleans().map(lambda b: not b)
        self.dim = st.sampled_from((3, 2, 4))
        # Microbatch size 1 (gap cases): every batch-shaped grad is then a
        # pass-through candidate, and size-1 dims admit any stride.
        self.batch = st.sampled_from((2, 3, 1) if gaps else (2, 3))
        # ``input_grad=MOSTLY`` (a target where some path needs an input that
        # requires grad and another does not): three cases in four have one.
        self.x_grad = st.sampled_from((True, True, True, False) if mostly_grad else (True, False))
        # Gap cases pull harder towards pass-through grads (3 in 18 blocks).
        blocks = BLOCKS + ("passthrough",) * 2 if gaps else BLOCKS
        blocks += extra
        blocks += tuple(m for m in MODEL_BLOCKS if m not in blocks) if model else ()
        if not random_ops:  # paths that cannot reproduce a seeded mask: not drawn only to be refused
            blocks = tuple(b for b in blocks if b != "dropout")
        if not hooks:  # paths that trace with fullgraph=True: no tensor hook, no retain_grad
            blocks = tuple(b for b in blocks if b not in ("hook", "retain"))
        element = st.tuples(st.sampled_from(blocks), st.integers(0, 2), st.integers(0, 3))
        if opinfo.draws():  # one block in four an op of torch's OpInfo database, shrinking away first
            element = st.one_of(element, element, element,
                                st.tuples(st.just(OPINFO_BLOCK), st.integers(0, 2), st.integers(0, len(opinfo.draws()) - 1)))
        self.blocks = st.lists(element, min_size=1, max_size=max_blocks)
        self.out_kind = st.integers(0, 4)
        # Model cases draw each microbatch count about equally often (st.integers
        # favours the ends of its range: 2 came in 91 of 500 eager+split cases,
        # 1 in 168); the founding draw stays as it was, so its streams do too.
        self.microbatches = (st.sampled_from(tuple(range(1, max_microbatches + 1))) if model
                             else st.integers(1, max_microbatches))
        # Pairwise draws (model cases): a rare op class and a training feature
        # the case must contain (``harness.generate.focus``), "" shrinking to none.
        self.focus_blocks = {exact: focus_blocks(exact, tuple(dict.fromkeys(blocks))) if model else None
                             for exact in (True, False)}
        self.focus_training = focus_training(retained_grads, hooks) if model else None
        self.steps = st.integers(1, 2)
        self.grad_init = st.sampled_from(("none", "zero", "prefilled"))
        self.zero_grad = st.sampled_from(("set_to_none", "zeros", "keep"))
        self.seed = st.integers(0, 2**16)

    @classmethod
    def get(cls, max_blocks: int, max_microbatches: int, gaps: bool = False, extra: tuple[str, ...] = (),
            model: bool = False, random_ops: bool = True, mostly_grad: bool = False,
            retained_grads: bool = True, hooks: bool = True) -> "_Drawn":
        key = (max_blocks, max_microbatches, gaps, extra, model, random_ops, mostly_grad, retained_grads, hooks)
        if key not in cls._made:
            cls._made[key] = cls(*key)
        return cls._made[key]


# ``cases`` lives here, beside the ``interpret`` it calls, because
# benchmarks/draw_stats.py swaps ``harness.generate.interpret`` to record
# which blocks each case was built from.
@st.composite
def cases(draw, exact: bool | None = None, max_blocks: int = 6, max_microbatches: int = 4,
          lifetime: bool = False, gaps: bool = False, model: bool = False, input_grad: bool | str = False,
          random_ops: bool = True, draws: tuple[Draw, ...] = (), takes: Callable[[Case], bool] | None = None,
          retained_grads: bool = True, hooks: bool = True) -> Case:
    """Valid cases; ``exact`` None draws the mode too. ``lifetime`` also draws
    buffer-lifetime schedules (allocator pressure between backwards, held
    outputs, parameter hooks); ``draws`` are the families' own knobs, drawn
    last and in order, so cases drawn without them are unchanged.
    ``input_grad``: True, x0 always requires grad; ``MOSTLY``, three cases in
    four (a target of paths that need it beside paths that do not); False,
    one in two. With ``model`` each case also draws a pair target
    (``harness.generate.focus``): a rare op class and a training feature it
    must contain, so that every pair of features turns up within a few
    hundred examples; ``retained_grads`` False (no path compares retained
    grads) leaves ``retain_grad`` out of those targets; ``hooks`` False
    leaves out tensor hooks and ``retain_grad`` altogether. ``takes`` (the
    target's "some path runs it"): a case none takes is repaired where
    ``repair`` can, not thrown away."""
    # The strategies are built once (_Drawn), not per draw: building and
    # validating them again for every case cost a third of generation.
    extra = tuple(dict.fromkeys(b for d in draws for b in d.blocks))
    s = _Drawn.get(max_blocks, max_microbatches, gaps, extra, model, random_ops, input_grad == MOSTLY, retained_grads,
                   hooks)
    if exact is None:
        exact = draw(s.exact)  # shrinks towards exact mode
    dim = draw(s.dim)
    batch = draw(s.batch)
    x_grad = True if input_grad is True else draw(s.x_grad)
    blocks = draw(s.blocks)
    if model:
        blocks = draw(s.focus_blocks[exact](blocks))
        blocks = draw(s.focus_training(blocks))  # type: ignore[misc]
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
    if takes is not None and not takes(case):
        case = repair(case, takes)
    return case

