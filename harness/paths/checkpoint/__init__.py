"""``checkpoint.*``: activation checkpointing: the paths (``path``) and
their canaries."""

from harness.paths.checkpoint.data import CASE_DATA
from harness.paths.family import Family, lazy

FAMILY = Family(
    "checkpoint",
    paths=lazy("harness.paths.checkpoint.paths:paths"),
    canaries=lazy("harness.paths.checkpoint.canaries:canaries"),
    case_data=CASE_DATA,
    docs="harness/paths/checkpoint/README.md",
    prefixes=("checkpoint",),
    machinery=("torch.utils.checkpoint", "torch.autograd.graph"),
)
