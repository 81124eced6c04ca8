"""``ddp.*`` and ``fsdp2.*``: data parallelism on the worker pool's process
group: the paths (``path``), what each rank runs (``rank``), the canaries
and the torchrun repro script (``script``)."""

from harness.paths.parallel.data import CASE_DATA
from harness.paths.family import Family, lazy

FAMILY = Family(
    "parallel",
    paths=lazy("harness.paths.parallel.paths:paths"),
    canaries=lazy("harness.paths.parallel.canaries:canaries"),
    scripts={"dataparallel": lazy("harness.paths.parallel.script:script")},
    case_data=CASE_DATA,
    docs="harness/paths/parallel/README.md",
    prefixes=("ddp", "fsdp2"),
    components={"ddp": "DDP", "fsdp2": "FSDP2"},
    machinery=("torch.nn.parallel", "torch.distributed.fsdp", "torch.distributed.algorithms.ddp_comm_hooks"),
)
