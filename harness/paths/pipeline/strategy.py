"""The pipeline family's own draws: stage cuts and a microbatch count for
one of a schedule's layouts (``Contract.draws``)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from harness.case.spec import Case
from harness.generate import Draw
from harness.paths.pipeline.data import Stages


@st.composite
def pipeline_stages(draw, case: Case, layouts: tuple[tuple[int, int], ...]) -> Case:
    """Cut ``case`` into stages for one of ``layouts`` ((stages, microbatches)
    pairs a schedule takes). Cuts are drawn as picks among the free node
    positions, so they shrink towards the earliest positions and fewer
    stages (merging); a case with too few nodes keeps fewer stages (outside
    the layout: skipped). About one parameter in five is frozen."""
    # Only layouts this case has nodes enough to cut into: a case drawn for a
    # layout it cannot fill is outside the contract and thrown away.
    fits = [x for x in sorted(layouts) if x[0] <= len(case.nodes)] or sorted(layouts)
    stages, microbatches = draw(st.sampled_from(fits))
    picks = draw(st.lists(st.integers(0, 255), min_size=stages - 1, max_size=stages - 1))
    free = list(range(1, len(case.nodes)))
    cuts = [free.pop(r % len(free)) for r in picks[:len(free)]]
    frozen = draw(st.lists(st.integers(0, 4), min_size=len(case.params), max_size=len(case.params)))
    params = tuple(replace(p, requires_grad=False) if f == 4 else p for p, f in zip(case.params, frozen))
    case = replace(case, params=params, schedule=replace(case.schedule, microbatches=microbatches))
    return case.with_data("pipeline", Stages(tuple(sorted(cuts))) if cuts else None)


def layout_draw(layouts: tuple[tuple[int, int], ...]) -> Draw:
    """The draw of a path that runs these (stages, microbatches) layouts."""
    return Draw("pipeline", (pipeline_stages,), (layouts,))
