"""``checkpoint.*``: activation checkpointing: the paths (``path``) and
their canaries."""

from harness.paths.family import Family, lazy

FAMILY = Family(
    "checkpoint",
    paths=lazy("harness.paths.checkpoint.path:paths"),
    canaries=lazy("harness.paths.checkpoint.canaries:canaries"),
    docs="docs/paths.md#checkpoint",
)
