"""The data-parallel family's own draws: DDP and FSDP2 switches, FSDP2 unit
cuts and a training step (``Contract.draws``)."""

from __future__ import annotations

from hypothesis import strategies as st

from harness.case.spec import Case
from harness.generate import ONE_IN_EIGHT, Draw, training_steps
from harness.paths.parallel.data import OPTIONS, Switches

@st.composite
def data_parallel(draw, case: Case) -> Case:
    """DDP / FSDP2 switches for one case (``Switches``), each a draw that
    shrinks to "off"; with ``units`` the node list is cut into FSDP2 units
    (``Switches.units``), so a weight used in two units lives in the root, tied
    across them. Then, as for DTensor, maybe a training step."""
    rare = ("bf16_reduce",)  # one case in eight: a low-precision case is compared loosely (compare.values.LOW_EPS)
    common = [o for o in OPTIONS if o not in rare]
    on = draw(st.lists(st.booleans(), min_size=len(common), max_size=len(common)))
    opts = [o for o, b in zip(common, on) if b]
    opts += [o for o in rare if draw(ONE_IN_EIGHT)]
    stages: tuple[int, ...] = ()
    free = list(range(1, len(case.nodes)))
    if "units" in opts and not free:
        opts.remove("units")
    if "units" in opts:
        picks = draw(st.lists(st.integers(0, 255), min_size=1, max_size=min(3, len(free))))
        stages = tuple(sorted({free.pop(r % len(free)) for r in picks if free}))
        if not stages:
            opts.remove("units")
    if "checkpoint" in opts and "units" not in opts:
        opts.remove("checkpoint")  # recomputation is per block
    case = case.with_data("parallel", Switches(tuple(opts), stages) if opts else None)
    return draw(training_steps(case))

SWITCHES = Draw("parallel", (data_parallel,))
