"""The checkpoint family's part of a case: where the node list is cut into
regions (the even segments are recomputed, the odd ones run plainly)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.case.namespace import DataNamespace, check_cuts, cuts
from harness.case.spec import Case


@dataclass(frozen=True)
class Regions:
    cuts: tuple[int, ...] = ()


def region_cuts(case: Case) -> tuple[int, ...]:
    data = case.data("checkpoint")
    return data.cuts if data is not None else ()


def _from_legacy(top: dict[str, Any]) -> Regions | None:
    return Regions(top["stages"]) if top["stages"] else None


CASE_DATA = DataNamespace("checkpoint", Regions, {"cuts": cuts(3)},
                          check=lambda case, v, where: check_cuts(case, v.cuts, f"{where}.cuts"),
                          from_legacy=_from_legacy)
