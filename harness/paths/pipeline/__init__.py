"""``pipeline.<schedule>.*``: stages through ``PipelineStage`` and torch's
schedules: the path (``path``), what each rank runs (``rank``), the
canaries and the repro script (``script``)."""

from harness.paths.pipeline.data import CASE_DATA
from harness.paths.family import Family, lazy

FAMILY = Family(
    "pipeline",
    paths=lazy("harness.paths.pipeline.paths:paths"),
    canaries=lazy("harness.paths.pipeline.canaries:canaries"),
    scripts={"pipeline": lazy("harness.paths.pipeline.script:script")},
    case_data=CASE_DATA,
    docs="harness/paths/pipeline/README.md",
    prefixes=("pipeline",),
    components={"pipeline": "pipelining"},
    machinery=("torch.distributed.pipelining",),
    probe_data=lambda cut: {"version": 1, "cuts": [1]} if cut else None,
)
