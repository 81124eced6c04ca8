"""The case schema's vocabulary: versions, allowed values, the one input error.

Both the spec (decoding JSON) and the validator (shapes, ranges) need these;
keeping them here lets the spec call the validator without the validator
importing the spec back.
"""

from __future__ import annotations

SCHEMA_VERSION = 1

DTYPES = ("float32", "float64")
GRAD_INITS = ("none", "zero", "prefilled")
ZERO_GRADS = ("set_to_none", "zeros", "keep")
HOOK_KINDS = ("scale", "observe")
# Buffer-lifetime schedule parts (see Schedule.events / param_hooks).
EVENT_KINDS = ("empty_cache", "alloc", "free")
PARAM_HOOKS = ("hook", "hook_keep", "post_accumulate")
EVENT_MAX_ELEMENTS = 2**22
# Data-parallel wrapper options (``Case.parallel``; harness.paths.parallel):
# each is one switch a DDP or FSDP2 user sets, so a case shrinks by dropping them.
PARALLEL_OPTIONS = (
    "no_sync",          # accumulate without synchronising all but each step's last microbatch
    "bucket_view",      # DDP gradient_as_bucket_view=True
    "static_graph",     # DDP static_graph=True
    "find_unused",      # DDP find_unused_parameters=True
    "small_buckets",    # DDP bucket_cap_mb tiny: one parameter per bucket, tied ones apart
    "hook_allreduce",   # DDP comm hook: the built-in allreduce hook (counted)
    "hook_builtin",     # DDP comm hook: the C++ built-in ALLREDUCE
    "keep_unsharded",   # FSDP2 reshard_after_forward=False
    "reshard_int",      # FSDP2 reshard_after_forward=1 (an int: reshard to a smaller world)
    "no_reshard_after_backward",  # FSDP2 set_reshard_after_backward(False) inside no_sync windows
    "units",            # a block per span of Case.stages (FSDP2: a unit each, besides the root)
    "checkpoint",       # each block recomputed in backward (non-reentrant torch.utils.checkpoint); needs units
)


class SpecError(ValueError):
    """A case that cannot be built; the message names the field."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where
