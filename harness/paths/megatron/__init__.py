"""``megatron.*``: the case's module under megatron-core's
``DistributedDataParallel`` (grad buffers, ``main_grad``, the distributed
optimizer's reduce-scatter) with gradient accumulation, and the case cut
into two pipeline stages under megatron's 1F1B schedule with a shared
embedding (``megatron.pp``), on the worker pool's process group: the paths
(``path``), what each rank runs (``rank``; ``pipe`` for the pipeline), the
one CPU patch (``cpu``), the standalone scripts (``script`` for the DDP
paths, ``pipe_script`` for the pipeline's), the DDP config and the cut as
case data (``data``), the canaries, and the page.

megatron-core is optional (``pip install 'gradfuzz[megatron]'``): without it
these paths are listed as unavailable with that command.
"""

from harness.paths.family import Family, lazy
from harness.paths.megatron.data import CASE_DATA

FAMILY = Family(
    "megatron",
    paths=lazy("harness.paths.megatron.paths:paths"),
    canaries=lazy("harness.paths.megatron.canaries:canaries"),
    scripts={"megatron": lazy("harness.paths.megatron.script:script"),
             "megatron.pipe": lazy("harness.paths.megatron.pipe.script:script")},
    case_data=CASE_DATA,
    docs="harness/paths/megatron/README.md",
    prefixes=("megatron",),
    components={"megatron": "Megatron-core"},
    machinery=("megatron.core.distributed", "megatron.core.pipeline_parallel", "megatron.core.optimizer"),
    probe_data=lambda cut: {"version": 1, "cut": 1, "cuts": [1, 2, 3]} if cut else None,
    package="megatron-core",
)
