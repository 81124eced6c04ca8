"""The toy family's part of a case: how many parts the loop splits its loss into."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from harness.case import schema as sc
from harness.case.namespace import DataNamespace
from harness.case.spec import Case
from harness.generate import Draw

PARTS = (2, 4)  # powers of two: each part's scale is exact in every dtype


@dataclass(frozen=True)
class Split:
    parts: int = 2


def parts_of(case: Case) -> int:
    data = case.data("twice")
    return data.parts if data is not None else 2


def _parts(v: Any, where: str) -> int:
    n = sc.integer(v, where, 1, 64)
    if n not in PARTS:
        raise sc.SpecError(where, f"{n} parts; the toy family splits a loss into {' or '.join(map(str, PARTS))}")
    return n


@st.composite
def _split(draw, case: Case) -> Case:
    return case.with_data("twice", Split(draw(st.sampled_from(PARTS))))


CASE_DATA = DataNamespace("twice", Split, {"parts": _parts})
PARTS_DRAW = Draw("twice", (_split,))
