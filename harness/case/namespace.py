"""A family's own part of a case: ``Case.family``, one namespace per family.

Stage cuts, checkpoint regions and data-parallel switches mean something to
one family only, so the core spec does not hold them: each family declares a
``DataNamespace`` (its ``Family.case_data``), and the spec reads and writes
``{"family": {NAME: {"version": V, ...}}}`` through it. The namespace is
versioned by its family, validated by it (types and bounds, then against
the rest of the case), and round-trips to JSON like the rest of the spec.
``from_legacy`` turns the fields of schema version 1, which had them at the
top of the case, into the namespace, so old corpus files still load.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

from harness.case import schema as sc
from harness.case.vocab import SpecError

# The case a namespace checks against is a ``harness.case.spec.Case``; it is
# typed Any because the spec imports this module, and the layers stay a tree.
Case = Any

Checker = Callable[[Any, str], Any]


@dataclass(frozen=True)
class DataNamespace:
    """A frozen dataclass ``cls`` as a family's part of the case spec.

    ``checkers`` decode each field (types and bounds, naming ``where``);
    ``check(case, value, where)`` holds it against the rest of the case;
    ``from_legacy(top)`` builds a value from the schema-1 top-level fields
    (``stages``, ``parallel``), or None when the case had none for it.
    """

    name: str
    cls: type
    checkers: dict[str, Checker]
    version: int = 1
    check: Callable[[Case, Any, str], None] = lambda case, value, where: None
    from_legacy: Callable[[dict[str, Any]], Any] = lambda top: None

    def decode(self, data: Any, where: str) -> Any:
        names = [f.name for f in fields(self.cls)]
        sc.obj(data, where, ("version",), names)
        if type(data["version"]) is not int or data["version"] != self.version:
            raise SpecError(f"{where}.version", f"{self.name} data version {sc._show(data['version'])}; the installed "
                            f"{self.name} family reads version {self.version} (upgrade it, or re-save the case with it)")
        return self.cls(**{n: self.checkers[n](data[n], f"{where}.{n}") for n in names if n in data})

    def encode(self, value: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version}
        for f in fields(value):
            v = getattr(value, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


def cuts(max_cuts: int = 3) -> Checker:
    """Cut positions in the node list: integers, at most ``max_cuts``."""
    return lambda v, w: tuple(sc.integer(x, f"{w}[{i}]", 0, 256) for i, x in enumerate(sc.array(v, w, max_cuts)))


def check_cuts(case: Case, cut_at: tuple[int, ...], where: str) -> None:
    """Increasing positions strictly inside the node list: every span has a node."""
    for i, c in enumerate(cut_at):
        if not 0 < c < len(case.nodes):
            raise SpecError(f"{where}[{i}]", f"a cut must be a node position in 1..{len(case.nodes) - 1}, got {c}")
        if i and c <= cut_at[i - 1]:
            raise SpecError(f"{where}[{i}]", f"cuts must increase, got {cut_at[i - 1]} then {c}")


def cuts_namespace(name: str, cls: type) -> DataNamespace:
    """A family whose part of the case is one tuple of cuts (``cls(cuts)``),
    taken from schema 1's top-level ``stages`` (pipeline stages, checkpoint regions)."""
    return DataNamespace(name, cls, {"cuts": cuts(3)},
                         check=lambda case, v, where: check_cuts(case, v.cuts, f"{where}.cuts"),
                         from_legacy=lambda top: cls(top["stages"]) if top["stages"] else None)
