"""Where families come from: the ``gradfuzz.paths`` entry points.

The built-in families are listed in ``BUILTIN`` in the entry-point form and
read exactly as installed ones are, so the core names none of them, and a
checkout run without installing still has them. This sits at the bottom of
the layers because the case spec asks it too: a family's part of a case
(``Case.family``) is decoded by that family.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any

# The built-in families, registered the way a third party registers one.
BUILTIN = (
    "eager = harness.paths.eager:FAMILY",
    "split = harness.paths.split:FAMILY",
    "dtensor = harness.paths.dtensor:FAMILY",
    "graphed = harness.paths.graphed:FAMILY",
    "pipeline = harness.paths.pipeline:FAMILY",
    "compile = harness.paths.compile:FAMILY",
    "checkpoint = harness.paths.checkpoint:FAMILY",
    "parallel = harness.paths.parallel:FAMILY",
    "deepspeed = harness.paths.deepspeed:FAMILY",
    "megatron = harness.paths.megatron:FAMILY",
    "torchtitan = harness.paths.torchtitan:FAMILY",
    "mesh = harness.paths.mesh:FAMILY",
    "func = harness.paths.func:FAMILY",
)
GROUP = "gradfuzz.paths"


def listed(builtin: tuple[str, ...] = BUILTIN) -> list[EntryPoint]:
    """Every registered entry point: the built-in ones first, then installed ones of other names."""
    own = [EntryPoint(*(x.strip() for x in line.split("=")), group=GROUP) for line in builtin]
    names = {ep.name for ep in own}
    return own + [ep for ep in entry_points(group=GROUP) if ep.name not in names]


# Case data of families brought in by ``--path`` or ``register_path`` (not entry points).
_added: dict[str, Any] = {}


def add_namespace(name: str, codec: Any) -> None:
    """Make family ``name``'s part of a case readable in this process."""
    _added[name] = codec


def namespace(name: str) -> Any:
    """The codec of family ``name``'s part of a case (its ``case_data``), or
    None when no registered family of that name has one or it does not import."""
    return _added.get(name) or getattr(_loaded(name), "case_data", None)


@lru_cache(maxsize=None)
def declared(field: str) -> dict[str, Any]:
    """Each registered family's ``field`` by name, where it has a value: for
    the modules below the path registry (the tracer in a rank process) that
    ask every family the same question without importing ``harness.paths``."""
    out = {}
    for ep in listed():
        value = getattr(_loaded(ep.name), field, None)
        if value:
            out[ep.name] = value
    return out


@lru_cache(maxsize=None)
def _loaded(name: str) -> Any:
    for ep in listed():
        if ep.name == name:
            try:
                return ep.load()
            except Exception:  # a family that does not import declares nothing; the spec says so
                return None
    return None
