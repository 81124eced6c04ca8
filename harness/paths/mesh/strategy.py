"""The mesh family's own draws: a placement on each of the two mesh dims per
parameter (``data.Placements``), then maybe a training step."""

from __future__ import annotations

from hypothesis import strategies as st

from harness.case.spec import Case
from harness.generate import Draw, tp_eligible, training_steps
from harness.paths.mesh.data import STYLES, Placements


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
