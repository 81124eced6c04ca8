"""The checkpoint family's part of a case: where the node list is cut into
regions (the even segments are recomputed, the odd ones run plainly)."""

from __future__ import annotations

from dataclasses import dataclass

from harness.case.namespace import cuts_namespace
from harness.case.spec import Case


@dataclass(frozen=True)
class Regions:
    cuts: tuple[int, ...] = ()


def region_cuts(case: Case) -> tuple[int, ...]:
    data = case.data("checkpoint")
    return data.cuts if data is not None else ()


CASE_DATA = cuts_namespace("checkpoint", Regions)
