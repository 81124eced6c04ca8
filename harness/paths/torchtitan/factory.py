"""The family's paths: the FSDP2 variants (``path``) and the TP one
(``tp``), which asks ``path`` whether torchtitan is usable here; one module
above both, so neither imports the other's factory (no import cycle)."""

from __future__ import annotations

from typing import Any

from harness.paths.base import Options
from harness.paths.torchtitan.tp import paths as tp
from harness.paths.torchtitan.paths import fsdp_paths


def paths(options: Options) -> list[Any]:
    return fsdp_paths(options) + tp.paths(options.world_size, options.timeout, options.backend)
