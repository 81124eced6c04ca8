"""``--coverage``: which family a path belongs to, and that family's machinery.

The tracer itself (``harness.machinery_coverage``) knows files, not paths;
this joins it to the families: a path's family is the one whose
``prefixes`` (or name) its name starts with, and a family's machinery is
what its ``Family.machinery`` declares (a third-party family's the same way
as a built-in one's).

Modes: ``measure`` traces every drawn example's path runs and reports the
lines reached; ``guide`` also hands each example's count of lines no earlier
example reached to Hypothesis's ``target()``, whose optimiser then climbs
from the examples that reached new machinery code.
"""

from __future__ import annotations

from functools import lru_cache

from harness.machinery_coverage import FamilyCoverage, Machinery, Meter, combine, request_in_children

MODES = ("measure", "guide")
GUIDE_LABEL = "new machinery lines"

__all__ = ["MODES", "GUIDE_LABEL", "Meter", "machinery_family", "machinery_of", "new_meter", "summary_lines",
           "combine", "FamilyCoverage", "request_in_children"]


@lru_cache(maxsize=None)
def _heads() -> dict[str, str]:
    """First part of a path name -> family name, from the registered families."""
    from harness.paths import families

    out: dict[str, str] = {}
    for fam in families():
        out.setdefault(fam.name, fam.name)
        for head in fam.prefixes:
            out.setdefault(head, fam.name)
    return out


def machinery_family(path_name: str) -> str:
    """The family of a path (``ddp.stock`` -> ``parallel``); its first name part when no family claims it."""
    head = path_name.split(".")[0]
    return _heads().get(head, head)


@lru_cache(maxsize=None)
def machinery_of(family: str) -> Machinery:
    """A family's files and reachable lines, read once per process: listing
    its files walks the installed packages."""
    return Machinery.of(family)


def new_meter() -> Meter:
    return Meter(machinery_of)


def summary_lines(coverage: dict[str, FamilyCoverage]) -> list[str]:
    """One ``machinery coverage`` line per family, in name order."""
    return [coverage[f].line() for f in sorted(coverage)]
