"""``torchtitan.*``: the case's module parallelized by torchtitan's own
functions (FSDP2 with its reshard policies, its activation-checkpoint
policies) and trained with its accumulation and loss reduction, on the
worker pool's process group: the paths (``path``), the case as a torchtitan
decoder (``model``), what each rank runs (``rank``), the CPU patch
(``cpu``), the knobs as case data (``data``), the canary, and the page.

torchtitan is optional (``pip install 'gradfuzz[torchtitan]'``): without it
these paths are listed as unavailable with that command.
"""

from harness.paths.family import Family, lazy
from harness.paths.torchtitan.data import CASE_DATA

FAMILY = Family(
    "torchtitan",
    paths=lazy("harness.paths.torchtitan.factory:paths"),
    canaries=lazy("harness.paths.torchtitan.canaries:canaries"),
    case_data=CASE_DATA,
    docs="harness/paths/torchtitan/README.md",
    prefixes=("torchtitan",),
    machinery=("torchtitan.distributed", "torch.distributed.fsdp", "torch.distributed.algorithms"),
    unprobed={"TorchtitanTPPath": "it builds torchtitan's Llama from its own draws, not the case's nodes"},
    package="torchtitan",
)
