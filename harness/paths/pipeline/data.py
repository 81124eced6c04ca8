"""The pipeline family's part of a case: where the node list is cut into stages."""

from __future__ import annotations

from dataclasses import dataclass

from harness.case.namespace import cuts_namespace
from harness.case.spec import Case


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
