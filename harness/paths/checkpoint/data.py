"""The checkpoint family's part of a case: where the node list is cut into
regions (the even segments are recomputed, the odd ones run plainly), and
its own draws: region cuts, frozen parameters, dropout and in-place blocks
(``Contract.draws``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import strategies as st

from harness.case.namespace import cuts_namespace
from harness.case.spec import Case
from harness.generate import OPTIONAL_BLOCKS, Draw


@dataclass(frozen=True)
class Regions:
    cuts: tuple[int, ...] = ()


def region_cuts(case: Case) -> tuple[int, ...]:
    data = case.data("checkpoint")
    return data.cuts if data is not None else ()


CASE_DATA = cuts_namespace("checkpoint", Regions)


@st.composite
def checkpoint_regions(draw, case: Case) -> Case:
    """Cut ``case`` into segments for the checkpoint paths (``Regions``:
    the even segments are recomputed, the odd ones run plainly, so one cut
    puts a tied weight inside and outside a region). Shrinks to no cut (the
    whole module one region). About one parameter in five is frozen, so some
    regions take no input that requires grad."""
    free = list(range(1, len(case.nodes)))
    picks = draw(st.lists(st.integers(0, 255), max_size=min(3, len(free))))
    cuts = {free.pop(r % len(free)) for r in picks if free}
    frozen = draw(st.lists(st.integers(0, 4), min_size=len(case.params), max_size=len(case.params)))
    params = tuple(replace(p, requires_grad=False) if f == 4 else p for p, f in zip(case.params, frozen))
    return replace(case, params=params).with_data("checkpoint", Regions(tuple(sorted(cuts))) if cuts else None)


REGIONS = Draw("checkpoint", (checkpoint_regions,), blocks=OPTIONAL_BLOCKS)
