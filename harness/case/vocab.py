"""The case schema's vocabulary: versions, allowed values, the one input error.

Both the spec (decoding JSON) and the validator (shapes, ranges) need these;
keeping them here lets the spec call the validator without the validator
importing the spec back.
"""

from __future__ import annotations

SCHEMA_VERSION = 2  # 2: stage cuts and data-parallel switches moved into their families (Case.family)

DTYPES = ("float32", "float64")
GRAD_INITS = ("none", "zero", "prefilled")
ZERO_GRADS = ("set_to_none", "zeros", "keep")
HOOK_KINDS = ("scale", "observe")
# Buffer-lifetime schedule parts (see Schedule.events / param_hooks).
EVENT_KINDS = ("empty_cache", "alloc", "free")
PARAM_HOOKS = ("hook", "hook_keep", "post_accumulate")
EVENT_MAX_ELEMENTS = 2**22


class SpecError(ValueError):
    """A case that cannot be built; the message names the field."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where
