"""The pipeline family's part of a case: where the node list is cut into
stages; and its own draws: stage cuts and a microbatch count for one of a
schedule's layouts (``Contract.draws``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import strategies as st

from harness.case.namespace import cuts_namespace
from harness.case.spec import Case
from harness.generate import Draw


@dataclass(frozen=True)
class Stages:
    """Each cut is a position in ``case.nodes`` where a new stage starts; no cut is one stage."""

    cuts: tuple[int, ...] = ()


def stage_cuts(case: Case) -> tuple[int, ...]:
    data = case.data("pipeline")
    return data.cuts if data is not None else ()


CASE_DATA = cuts_namespace("pipeline", Stages)


@dataclass(frozen=True)
class Machinery:
    """What the pipeline script needs of a path: its schedule, stage class,
    the rank of each stage and the world size (``Repro.family``)."""

    schedule: str
    stage_impl: str
    placement: tuple[int, ...]
    world_size: int = 1


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
