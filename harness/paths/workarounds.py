"""Which path applies which outside workaround, so the gate can test "known" causally.

A path offers a workaround either by listing its name in ``workarounds``
(the in-process ones of ``harness.materialize.workarounds``: the path builds its
parameters and trainer in this process, so the context variable reaches
them) or by ``with_workaround(name)`` returning a path of its own (the
split twin). Anything else cannot apply it, and its findings stay "known by
signature only".

A fix probe (``harness.materialize.probes``) applies on every path: it
patches torch itself, and every path runs its case either in this process or
in a worker, rank or child process whose message carries the effects in
force (``in_force_now``) and runs the case inside ``in_force``, so no path
needs code or a declaration of its own to take one.
"""

from __future__ import annotations

from typing import Any

from harness.materialize import probes
from harness.materialize.workarounds import in_force
from harness.case.spec import Case
from harness.paths.base import in_child
from harness.observation import Observation

# The workarounds a path running its schedule in this process applies with no code of its own.
IN_PROCESS = ("clone-grads", "optimizer-for-loop")


class WorkedAround:
    """``path`` with one outside workaround in force; the same name, contract and repro."""

    def __init__(self, path: Any, workaround: str) -> None:
        self.path, self.workaround = path, workaround
        self.name, self.contract = path.name, path.contract

    def availability(self) -> Any:
        return self.path.availability()

    def supports(self, case: Case) -> str | None:
        return self.path.supports(case)

    def run(self, case: Case) -> Observation:
        with in_force(self.workaround, here=not in_child(_innermost(self.path))):
            return self.path.run(case)

    def repro(self, case: Case) -> Any:
        return self.path.repro(case)


def _innermost(path: Any) -> Any:
    """The path under any workarounds wrapped around it."""
    while isinstance(path, WorkedAround):
        path = path.path
    return path


def apply(path: Any, workaround: str) -> Any | None:
    """``path`` with ``workaround`` (or a fix probe) applied from outside, or None where it cannot be."""
    if workaround in probes.PROBES:
        return WorkedAround(path, workaround)
    own = getattr(path, "with_workaround", None)
    made = own(workaround) if callable(own) else None
    if made is not None:
        return made
    return WorkedAround(path, workaround) if workaround in getattr(path, "workarounds", ()) else None
