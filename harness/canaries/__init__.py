"""Canaries: deliberately wrong implementations the harness must catch.

They ship with the package because ``gradfuzz selfcheck`` (and ``gate``,
which runs it first) proves on the user's own installation that detection
still works: a gate that silently lost its teeth after an upgrade must not
pass. One module per path family (``split``, ``dtensor``, ``pipeline``),
each with a ``canaries()`` list; a canary is judged relative to its base
path, so what is caught is the injected bug, not another bug the base has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from packaging.version import Version

FAMILIES = ("harness.canaries.split", "harness.canaries.dtensor", "harness.canaries.pipeline", "harness.canaries.compile",
            "harness.canaries.checkpoint", "harness.canaries.parallel")


@dataclass(frozen=True)
class Canary:
    """A broken path, the path it is judged against, and a detection budget."""

    name: str
    make: Callable[[], Any]
    base: str | None
    budget: int = 300
    needs_clamp: bool = False  # stock split must be 2.13+ to be a clean base
    # The finding kinds the injected bug produces. A canary is caught only by
    # a finding of these kinds on a case where its base agrees (the injection
    # removed, the finding goes away); anything else it shows (an exception
    # from its own code on this torch, say) means the canary is broken.
    expects: tuple[str, ...] = ("value",)
    # Run instead when this canary cannot run here (a layout this torch lacks).
    fallback: "Canary | None" = None
    shrink: bool = True  # False: stop at the first failing example (paths where each shrink step compiles)

    def base_here(self) -> tuple[str | None, str]:
        """The base to judge against on the installed torch, and why it is not ``base``.

        Before 2.13 stock split has the founding double count itself, so a
        canary built over it is judged against the fixed path instead: what
        is caught is then the injected bug together with stock's own, which
        on those versions is the same shape.
        """
        if self.needs_clamp and self.base and Version(torch.__version__.split("+")[0]) < Version("2.13"):
            fixed = self.base.rsplit(".", 1)[0] + ".fixed"
            return fixed, f"judged against {fixed}: stock split before 2.13 double counts itself"
        return self.base, ""

    def resolve_base(self) -> tuple[Any, str, str]:
        """The base path to judge against here (None: none), the note of
        ``base_here``, and why the canary cannot run ("" if it can)."""
        from harness.paths import resolve

        name, note = self.base_here()
        if not name:
            return None, note, ""
        base = resolve(name)[0]
        available = base.availability()
        return base, note, "" if available.ok else f"base {name} unavailable: {available.reason}"


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
