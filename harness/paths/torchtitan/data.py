"""The torchtitan family's part of a case: the knobs of torchtitan's config
that reach its parallelize functions, and where the case is cut into the
transformer blocks (``model.layers``) those functions wrap one by one.
Each draw shrinks to torchtitan's default (and to no cut)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from harness.case import schema as sc
from harness.case.namespace import DataNamespace, check_cuts, cuts
from harness.case.spec import Case
from harness.generate import Draw

# parallelism.fsdp_reshard_after_forward
POLICIES = ("default", "always", "never")
# activation_checkpoint.determinism_check (torch.utils.checkpoint's choices)
DETERMINISM = ("default", "none")


@dataclass(frozen=True)
class Knobs:
    reshard: str = "default"
    layers: tuple[int, ...] = ()  # cut positions in case.nodes: a block per span; none: one block
    preserve_rng: bool = True  # activation_checkpoint.preserve_rng_state
    determinism: str = "default"


def knobs(case: Case) -> Knobs:
    return case.data("torchtitan") or Knobs()


@st.composite
def _knobs(draw, case: Case) -> Case:
    free = list(range(1, len(case.nodes)))
    picks = draw(st.lists(st.integers(0, 255), max_size=min(3, len(free))))
    layers = tuple(sorted({free.pop(r % len(free)) for r in picks if free}))
    k = Knobs(draw(st.sampled_from(POLICIES)), layers, not draw(st.booleans()), draw(st.sampled_from(DETERMINISM)))
    return case.with_data("torchtitan", None if k == Knobs() else k)


KNOBS = Draw("torchtitan", (_knobs,))
CASE_DATA = DataNamespace("torchtitan", Knobs, {
    "reshard": lambda v, w: sc.string(v, w, choices=POLICIES),
    "layers": cuts(3),
    "preserve_rng": sc.boolean,
    "determinism": lambda v, w: sc.string(v, w, choices=DETERMINISM),
}, check=lambda case, v, where: check_cuts(case, v.layers, f"{where}.layers"))
