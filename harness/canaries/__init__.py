"""Canaries: deliberately wrong implementations the harness must catch.

They ship with the package because ``gradfuzz selfcheck`` (and ``gate``,
which runs it first) proves on the user's own installation that detection
still works: a gate that silently lost its teeth after an upgrade must not
pass. One module per path family (``split``, ``dtensor``, ``pipeline``,
``graphed``, ...), each with a ``canaries()`` list; a canary is judged relative to its base
path, so what is caught is the injected bug, not another bug the base has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from packaging.version import Version

FAMILIES = ("harness.canaries.split", "harness.canaries.dtensor", "harness.canaries.pipeline", "harness.canaries.compile",
            "harness.canaries.checkpoint", "harness.canaries.parallel", "harness.canaries.graphed")


@dataclass(frozen=True)
class Canary:
    """A broken path, the path it is judged against, and a detection budget."""

    name: str
    make: Callable[[], Any]
    base: str | None
    budget: int = 300
    # The injected bug is the installed stock's own before torch 2.13 (the
    # founding nested double count): there, removing the injection removes
    # nothing, so the canary proves nothing and its ``fallback`` runs instead.
    needs_clamp: bool = False
    # The finding kinds the injected bug produces. A canary is caught only by
    # a finding of these kinds on a case where its base agrees (the injection
    # removed, the finding goes away); anything else it shows (an exception
    # from its own code on this torch, say) means the canary is broken.
    expects: tuple[str, ...] = ("value",)
    # Run instead when this canary cannot run here (a layout this torch lacks).
    fallback: "Canary | None" = None
    shrink: bool = True  # False: stop at the first failing example (paths where each shrink step compiles)

    def proves_nothing_here(self) -> str:
        """Why this canary cannot be causal on the installed torch ("" if it can)."""
        if self.needs_clamp and Version(torch.__version__.split("+")[0]) < Version("2.13"):
            return (f"its injected bug is {self.base}'s own before torch 2.13 (the nested double count): "
                    "with the injection removed the bug stays, so a finding could not be told from it")
        return ""

    def resolve_base(self) -> tuple[Any, str]:
        """The base path to judge against (the canary without its injection;
        None: none) and why the canary cannot run here ("" if it can)."""
        from harness.paths import resolve

        why = self.proves_nothing_here()
        if why or not self.base:
            return None, why
        base = resolve(self.base)[0]
        available = base.availability()
        return base, "" if available.ok else f"base {self.base} unavailable: {available.reason}"


def all_canaries() -> list[Canary]:
    """Every family's canaries."""
    import importlib

    found: list[Canary] = []
    for mod in FAMILIES:
        found.extend(importlib.import_module(mod).canaries())
    return found


def select(names: str | None) -> list[Canary] | None:
    """``--canaries a,b``: those canaries in the order given (None: all)."""
    if not names:
        return None
    from harness.paths import UsageError

    known = {c.name: c for c in all_canaries()}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        raise UsageError(f"--canaries {names}: unknown canary {', '.join(unknown) or '(none named)'}; "
                         f"expected some of {', '.join(known)}")
    return [known[n] for n in wanted]
