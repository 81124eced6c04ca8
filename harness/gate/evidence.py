"""What the corpus replay showed of the ledger in this run, read by the
phases after it.

A ledger entry's recorded signatures are those its cases showed when it was
filed; signatures depend on the case's numbers and the path, so what the
bug's own cases show here and now is better evidence. A later finding with a
signature a bug's cases showed in the replay, or (on a sibling path the
entry covers) a shape they showed, is that bug.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.gate import ledger as ledger_mod
from harness.gate.rows import Row
from harness.observation import Divergence

Key = tuple[str, str]  # (path, signature)


@dataclass
class Evidence:
    led: ledger_mod.Ledger
    version: str
    seen_as: dict[Key, ledger_mod.Site] = field(default_factory=dict)  # the bug the replay filed it under
    seen_by: dict[Key, set[str]] = field(default_factory=dict)  # every bug whose own cases showed it
    shapes: set[tuple[str, str]] = field(default_factory=set)  # (bug id, shape) its own cases showed

    @classmethod
    def of(cls, led: ledger_mod.Ledger, version: str, reproduced: dict[str, list[Divergence]]) -> Evidence:
        """From the divergences the replay filed under each bug id."""
        ev = cls(led, version)
        for i, divs in reproduced.items():
            for d in divs:
                ev.seen_as[(d.path, d.signature)] = _site(led, i, d.path)
                ev.seen_by.setdefault((d.path, d.signature), set()).add(i)
                if d.shape:
                    ev.shapes.add((i, d.shape))
        return ev

    def owner(self, d: Divergence) -> ledger_mod.Site | None:
        """The bug the replay showed ``d``'s (path, signature) under, else one
        whose cases showed its shape on a path the bug's entry covers."""
        return self.seen_as.get((d.path, d.signature)) or by_shape(self.led, self.shapes, d, self.version)

    def others(self, r: Row) -> list[ledger_mod.Site]:
        """Every bug affecting this version that a row's signature fits on its
        path, other than the one the match picked: coarse signatures (a value
        ratio class, "no grad") are shared by bugs of one path, and a
        workaround that leaves the case wrong says only that it is not that one."""
        shape = (r.divergence or {}).get("shape")
        ids = self.seen_by.get((r.path, r.signature or ""), set())
        fits = [b for b in self.led.for_path(r.path) if r.signature in b.signatures or b.id in ids
                or shape and (b.id, shape) in self.shapes]
        out: list[ledger_mod.Site] = []
        for b in fits:
            if b.id != r.bug and b.relation(self.version) == "in" and all(b.id != o.id for o in out):
                out.append(b)
        return out


def by_shape(led: ledger_mod.Ledger, shapes: set[tuple[str, str]], d: Divergence,
             version: str) -> ledger_mod.Site | None:
    """A bug whose entry covers ``d``'s path and whose own cases showed ``d``'s
    shape on some path in this run; one affecting ``version`` wins."""
    return ledger_mod.first([b for b in led.for_path(d.path) if (b.id, d.shape) in shapes], version)


def _site(led: ledger_mod.Ledger, bug_id: str, path: str) -> ledger_mod.Site:
    """Bug ``bug_id`` where ``path`` is: its place covering the path, else its
    first place (a divergence its own case showed on a path it does not list)."""
    bug = led.bug(bug_id)
    return bug.at(path) or bug.sites[0]
