"""``deepspeed.*``: the case's module under a DeepSpeed engine (ZeRO 0 to 3)
with gradient accumulation, on the worker pool's process group: the paths
(``path``), what each rank runs (``rank``), the engine's knobs as case data
(``data``), the canary, the standalone scripts (``script`` for ZeRO,
``pipescript`` for the pipeline engine), and the page.

DeepSpeed is optional (``pip install 'gradfuzz[deepspeed]'``): without it
these paths are listed as unavailable with that command.
"""

from harness.paths.deepspeed.data import CASE_DATA
from harness.paths.family import Family, lazy

FAMILY = Family(
    "deepspeed",
    paths=lazy("harness.paths.deepspeed.pipe.paths:family_paths"),
    canaries=lazy("harness.paths.deepspeed.canaries:canaries"),
    scripts={"deepspeed": lazy("harness.paths.deepspeed.script:script"),
             "deepspeed.pipe": lazy("harness.paths.deepspeed.pipe.script:script")},
    case_data=CASE_DATA,
    docs="harness/paths/deepspeed/README.md",
    prefixes=("deepspeed",),
    components={"deepspeed": "DeepSpeed"},
    machinery=("deepspeed.runtime.zero", "deepspeed.runtime.pipe", "deepspeed.runtime.engine"),
    unprobed={"MisusePath": "every case it takes carries a misuse; it runs deepspeed.zeroN.stock's engine and loop"},
    package="deepspeed",
)
