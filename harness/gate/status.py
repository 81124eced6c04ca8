"""The gate's statuses, written once: worst first, with the words each report
uses and whether the status fails the gate. Reports, the versions table and
the report loader all read this table, so a new status cannot be shown in one
form and forgotten in another."""

from __future__ import annotations

from typing import NamedTuple


class Status(NamedTuple):
    words: str  # terminal, Markdown, JUnit, HTML
    short: str  # a cell of ``gradfuzz table``
    fails: bool


STATUSES: dict[str, Status] = {
    "error": Status("HARNESS ERROR (part of the gate did not run)", "ERROR", True),
    "selfcheck": Status("SELF-CHECK FAILED", "SELFCHECK", True),
    "regression": Status("REGRESSION (known bug back on a version that had it fixed)", "REGRESSION", True),
    "range_wrong": Status("RANGE WRONG (a known bug's signature on a version before its ledger range)", "RANGE WRONG",
                          True),
    "resembles": Status("RESEMBLES a known bug, but its workaround does not remove it", "RESEMBLES", True),
    "new": Status("NEW divergence", "NEW", True),
    "fixed": Status("known bug fixed by this version", "fixed", False),
    "known": Status("known bug, expected on this version (its workaround removes it)", "known", False),
    # Confirmed by a fix probe: an in-process patch of torch (the upstream fix,
    # or the one function at fault corrected) removes it. A check, not advice:
    # there is no outside workaround to keep.
    "known_probe": Status("known bug, expected on this version (its fix probe removes it; no outside workaround)",
                          "known (probe)", False),
    "known_signature_only": Status("known bug by signature only (no workaround to confirm it here)",
                                   "known (signature)", False),
    "not_reproduced": Status("known bug not reproduced (ledger range may be too wide)", "not reproduced", False),
    "unavailable": Status("path unavailable", "unavailable", False),
}
ORDER = list(STATUSES)
FAILING = tuple(k for k, s in STATUSES.items() if s.fails)
