"""The mesh family's own draws: a placement on each of the two mesh dims per
parameter (``data.Placements``), then maybe a training step; for
``mesh.pp_dp``, a pipeline layout and a data-parallel wrapper."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from harness.case.spec import Case
from harness.generate import Draw, tp_eligible, training_steps
from harness.paths.mesh.data import DP_WRAPPERS, PP_SCHEDULES, STYLES, Placements

MAX_MICROBATCHES = 4  # as the pipeline family probes its layouts


def min_microbatches(schedule: str) -> int:
    """Schedule1F1B's constructor refuses fewer microbatches than stages (2 here)."""
    return 2 if schedule == "1F1B" else 1


@st.composite
def mesh_placements(draw, case: Case) -> Case:
    """Each parameter's dp and tp placements, and whether grad outputs are
    Partial over "dp"; shrinks to Replicate grad outputs and parameters
    (then the namespace is dropped: that is the default)."""
    codes = []
    for p in case.params:
        dims = tuple(f"S{d}" for d in range(len(p.shape)))
        dp = draw(st.sampled_from(("R",) + dims))
        tp = draw(st.sampled_from(("R",) + dims + (STYLES if tp_eligible(case, p.name) else ())))
        codes.append(f"{dp},{tp}")
    partial = draw(st.booleans())
    data = Placements(tuple(codes), partial)
    case = case.with_data("mesh", data if partial or any(c != "R,R" for c in codes) else None)
    return draw(training_steps(case))


MESH = Draw("mesh", (mesh_placements,))


@st.composite
def pp_dp_layout(draw, case: Case) -> Case:
    """``mesh.pp_dp``: a schedule and a data-parallel wrapper (mesh case
    data), one cut into two pipeline stages (the pipeline family's
    ``family.pipeline.cuts``) and microbatches the schedule takes; about one
    parameter in five frozen, as the pipeline family draws them. Shrinks to
    GPipe, DDP, the earliest cut and the fewest microbatches."""
    from harness.registry import namespace

    schedule = draw(st.sampled_from(PP_SCHEDULES))
    wrapper = draw(st.sampled_from(DP_WRAPPERS))
    microbatches = draw(st.integers(min_microbatches(schedule), MAX_MICROBATCHES))
    frozen = draw(st.lists(st.integers(0, 4), min_size=len(case.params), max_size=len(case.params)))
    params = tuple(replace(p, requires_grad=False) if f == 4 else p for p, f in zip(case.params, frozen))
    case = replace(case, params=params, schedule=replace(case.schedule, microbatches=microbatches))
    if len(case.nodes) > 1:
        at = 1 + draw(st.integers(0, len(case.nodes) - 2))
        case = case.with_data("pipeline", namespace("pipeline").cls((at,)))
    else:  # one node: one stage, outside the contract (skipped)
        case = case.with_data("pipeline", None)
    data = Placements((), False, "" if schedule == PP_SCHEDULES[0] else schedule,
                      "" if wrapper == DP_WRAPPERS[0] else wrapper)
    return case.with_data("mesh", data if data != Placements() else None)


PP_DP = Draw("mesh_pp_dp", (pp_dp_layout,))
