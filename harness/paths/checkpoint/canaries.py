"""The checkpoint family's canary: the fixed recomputation with its RNG
restore switched off, so dropout inside a region redraws its mask in the
recomputed forward (wrong grads) and leaves the generator past where the
forward left it (a different RNG state after backward); judged against
``checkpoint.fixed``."""

from __future__ import annotations

from harness.paths.family import Canary
from harness.paths.checkpoint.paths import CheckpointPath, forgets_rng


def canaries() -> list[Canary]:
    return [Canary("checkpoint_forgets_rng",
                   lambda: CheckpointPath("canary.checkpoint_forgets_rng", forgets_rng), "checkpoint.fixed",
                   expects=("value", "rng"))]
