"""How ``deepspeed.pipe.*`` cuts a case into DeepSpeed's two stages: what a
rank builds (``piperank``) and what the standalone script builds
(``pipescript``) come from here, so the two cannot cut differently."""

from __future__ import annotations

from dataclasses import replace

from harness.case.spec import Case
from harness.materialize.stages import StageSpec, Value, cut


def cut_of(case: Case) -> list[StageSpec]:
    data = case.data("pipeline")
    return cut(case, tuple(data.cuts) if data is not None else ())


def tied_params(case: Case) -> set[str]:
    """Parameters both stages use: a copy on each, tied by ``TiedLayerSpec``."""
    specs = cut_of(case)
    return set(specs[0].params) & set(specs[-1].params) if len(specs) > 1 else set()


def bodies(case: Case) -> list[tuple[tuple[str, ...], StageSpec]]:
    """Each stage as the engine is handed it (``piperank`` and the standalone
    script build the same layers from this): the tied parameters it uses,
    one ``TiedLayerSpec`` each that appends its weight to the activations,
    then its own nodes over the other parameters, which take those weights
    after the activations."""
    tied = tied_params(case)
    out = []
    for spec in cut_of(case):
        mine = tuple(n for n in spec.params if n in tied)
        out.append((mine, replace(spec, params=tuple(n for n in spec.params if n not in tied),
                                  inputs=spec.inputs + tuple(Value(n) for n in mine))))
    return out
