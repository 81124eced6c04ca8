"""Pair targets: what each drawn case is made to contain, so that pairs of
features turn up within a few hundred examples.

A case's features fall into four classes: the families' knobs, the op
classes present, the schedule (mode, microbatches, steps, grad_init, tying)
and training (optimizer, clip, zero_grad, hooks, ``retain_grad``).
``benchmarks/pairs.py`` counts which cross-class pairs the first 500
examples of each fuzz target contain. Drawn as plain random blocks, the rare
op classes (attention, a cross-entropy loss, softmax, gated MLPs: one block
kind in 27, and only in tolerance mode) and the training features that
blocks make (an observing hook, ``retain_grad``: 5 and 9 cases in 500 for
eager+split) came too seldom for their pairs with everything else to turn
up at all.

So a model case draws two targets besides its random blocks: a rare op
class (``focus_blocks``: one of those the mode can build, each equally
likely; its block replaces one drawn block, so a case grows no larger) and a
training feature (``focus_training``: a scaling hook, an observing hook or
``retain_grad`` on the last node, each equally likely). Uniform targets make
every (rare op class, other feature) pair about as likely as its two
marginals allow, where the block list made it the product of two small
ones. Both are ordinary draws, so a case stays a function of Hypothesis's
choices (the same seed draws the same cases, shrinking replays them), and
both shrink to "no target" (index 0): a failure that does not need the
forced block loses it.

Why not Hypothesis's ``target()``: it steers a hill climb of one score
after the generate phase, and only within a round's budget; a set of pairs
to cover is not one score. Why not a fixed covering array walked in order:
the row would come from state outside the choice sequence, which shrinking
cannot replay.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from hypothesis import strategies as st

from harness.case.spec import Case

# ``cases(input_grad=MOSTLY)``: x0 requires grad in three cases of four.
MOSTLY = "mostly"

# (block, variants) per rare op class, by mode. In exact mode the norm,
# attention, gated-MLP and softmax/loss builders decline (tolerance only).
_TOLERANCE = (
    ("attention", (0, 1, 2, 3)),
    ("norm", (0, 1, 2, 3)),
    ("mlp", (0, 1, 2, 3)),
    ("head", (0, 1)),  # softmax / log_softmax of the tied head's logits
    ("head", (2, 3)),  # the same with a cross-entropy loss beside the output
    ("embed", (0, 1, 2, 3)),
    ("index", (0, 1, 2, 3)),
    ("expand", (0, 1, 2, 3)),
    ("inplace", (0, 1, 2, 3)),
    ("dropout", (0,)),
)
_EXACT = tuple(o for o in _TOLERANCE if o[0] in ("embed", "index", "expand", "inplace", "dropout"))

# (block, variant) per training feature a block makes: a hook that scales
# (variant 0: factor 2 in both modes), one that observes (variant 2: factor
# 1 in exact mode, "observe" in tolerance mode) and retain_grad.
_TRAINING = (("hook", 0), ("hook", 2), ("retain", 0))

Blocks = list[tuple[str, int, int]]


def focus_blocks(exact: bool, available: tuple[str, ...]) -> Callable[[Blocks], Any]:
    """``blocks -> strategy of blocks`` with one drawn block replaced by a
    rare op class's block (or unchanged: the shrink target). Only block kinds
    in ``available`` (what the target draws anyway: no dropout where every
    path refuses it) are targets."""
    options = tuple(o for o in (_EXACT if exact else _TOLERANCE) if o[0] in available)
    pick = st.sampled_from((None,) + options)
    slot = st.integers(0, 2)

    @st.composite
    def focused(draw: Any, blocks: Blocks) -> Blocks:
        chosen = draw(pick)
        if chosen is None:
            return blocks
        block, variants = chosen
        variant = draw(st.sampled_from(variants))
        at = draw(st.integers(0, len(blocks) - 1)) if blocks else 0
        return blocks[:at] + [(block, draw(slot), variant)] + blocks[at + 1:]

    return focused


def focus_training(retained_grads: bool = True, hooks: bool = True) -> Callable[[Blocks], Any]:
    """``blocks -> strategy of blocks`` with a hook or ``retain_grad`` on the
    last node appended (or unchanged: the shrink target). Neither adds a
    node, so the case's size is unchanged. Without ``retained_grads`` (no
    path of the target compares retained grads: the graphed paths, one of
    which refuses them) ``retain_grad`` is no target: it doubled
    graphed.compile's skipped examples. Without ``hooks`` there is no
    target at all."""
    pick = st.sampled_from((None,) + tuple(t for t in _TRAINING if hooks and (retained_grads or t[0] != "retain")))

    @st.composite
    def focused(draw: Any, blocks: Blocks) -> Blocks:
        chosen = draw(pick)
        if chosen is None:
            return blocks
        block, variant = chosen
        return blocks + [(block, 0, variant)]

    return focused


def repair(case: Case, takes: Callable[[Case], bool]) -> Case:
    """``case`` with the core's grad-state knobs at their defaults (every
    ``.grad`` empty before the first backward, cleared to None between
    steps) when no path of the target takes it as drawn and takes it so;
    else ``case`` unchanged (the target's filter then redraws it).

    Frameworks that own ``.grad`` (DeepSpeed's engine, megatron's
    ``main_grad``) refuse a prefilled grad and ``zero_grad="keep"``: two
    thirds of what their targets drew was thrown away for these two knobs
    alone (benchmarks/pairs.py). Resetting them is a plain function of the
    case, so the case stays a function of Hypothesis's choices, and it keeps
    every other drawn feature, where a redraw would start over."""
    s = case.schedule
    if s.grad_init == "none" and s.zero_grad == "set_to_none":
        return case
    fresh = replace(case, schedule=replace(s, grad_init="none", zero_grad="set_to_none"))
    return fresh if takes(fresh) else case
