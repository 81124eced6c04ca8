"""The pipeline family's part of a case: where the node list is cut into stages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.case.namespace import DataNamespace, check_cuts, cuts
from harness.case.spec import Case


@dataclass(frozen=True)
class Stages:
    """Each cut is a position in ``case.nodes`` where a new stage starts; no cut is one stage."""

    cuts: tuple[int, ...] = ()


def stage_cuts(case: Case) -> tuple[int, ...]:
    data = case.data("pipeline")
    return data.cuts if data is not None else ()


def _from_legacy(top: dict[str, Any]) -> Stages | None:
    return Stages(top["stages"]) if top["stages"] else None


CASE_DATA = DataNamespace("pipeline", Stages, {"cuts": cuts(3)},
                          check=lambda case, v, where: check_cuts(case, v.cuts, f"{where}.cuts"),
                          from_legacy=_from_legacy)


@dataclass(frozen=True)
class Machinery:
    """What the pipeline script needs of a path: its schedule, stage class,
    the rank of each stage and the world size (``Repro.family``)."""

    schedule: str
    stage_impl: str
    placement: tuple[int, ...]
    world_size: int = 1
