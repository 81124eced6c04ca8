"""``gradfuzz replay``'s verdict: each (case, path) run as known, new, fixed, ...

The authority is the case's own ``meta.expect`` (the paths and torch ranges on
which it is a known bug), as for the pytest plugin's replay items. Counting
runs by what they mean keeps the last line honest: "no divergence" after 290
known divergences told a reader the opposite of what happened.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from harness.artifacts.corpus import Entry, covers, relation

# The words of the summary line, in the order shown; every status but these is silent.
SHOWN = ("known", "new", "fixed", "regression", "not_reproduced")
WORDS = {"not_reproduced": "not reproduced"}


def status(entry: Entry, path: str, diverged: bool, version: str) -> str | None:
    """What one run of ``entry`` on ``path`` means on torch ``version``:
    ``known`` (diverges where the case expects it), ``new`` (diverges, not
    expected), ``regression`` (diverges on a version past the range the case
    expects it in), ``fixed`` (agrees past that range), ``not_reproduced``
    (agrees inside it), or None (agrees and expects nothing here)."""
    if entry.expected_on(path, version):
        return "known" if diverged else "not_reproduced"
    past = any(_after(e, path, version) for e in entry.meta.get("expect", []))
    if diverged:
        return "regression" if past else "new"
    return "fixed" if past else None


def _after(expect: dict[str, Any], path: str, version: str) -> bool:
    """Whether this environment is past the range of an expectation on ``path``
    (the ledger's rule, ``corpus.relation``, so both say "fixed" alike)."""
    return covers(expect.get("path", ""), path) and \
        relation(expect.get("torch", ""), expect.get("packages", {}), version) == "after"


def line(counts: Counter, unavailable: int) -> str:
    """``gradfuzz replay: N known, M new, K fixed`` plus any other status that occurred."""
    parts = [f"{counts.get(s, 0)} {WORDS.get(s, s)}" for s in SHOWN if s in ("known", "new", "fixed") or counts.get(s)]
    if unavailable:
        parts.append(f"{unavailable} path(s) unavailable")
    return "gradfuzz replay: " + ", ".join(parts) + " (runs of a case on a path)"
