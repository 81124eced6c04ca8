"""What the DTensor family's torchrun script needs of a path (``Repro.family``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Machinery:
    """The grad-layout handling under test (``"stock"`` or MODULE[:ATTR]) and the world size."""

    impl: str
    world_size: int
