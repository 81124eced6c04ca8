"""Gate reports from several torch versions side by side.

Rows are ledger bugs and new findings, columns are torch versions; a cell
is the gate's status for that row on that version. A ledger bug is one row
however many paths show it (a known row names a concrete path, a fixed row
the entry's pattern): the question is whether the bug is there, and each
report has the paths.
"""

from __future__ import annotations

from typing import Any

from packaging.version import Version

from harness.gate.status import STATUSES

SHORT = {k: s.short for k, s in STATUSES.items()}


def table(reports: list[dict[str, Any]]) -> str:
    reports = sorted(reports, key=lambda r: Version(r["torch"].split("+")[0]))
    cols = [r["torch"] for r in reports]
    rows: dict[str, dict[str, str]] = {}
    for rep in reports:
        for row in rep["rows"]:
            if row["status"] == "unavailable":
                key = f"{row['path']} (path)"
            elif row["bug"]:
                key = row["bug"]
            else:
                key = f"{row['path']}: {row['signature'] or row['detail'][:50]}"
            cell = rows.setdefault(key, {})
            if cell.get(rep["torch"]) not in ("NEW", "REGRESSION", "known", "known (probe)"):
                cell[rep["torch"]] = SHORT[row["status"]]
    head = ["| row | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
    body = [f"| {k} | " + " | ".join(v.get(c, "-") for c in cols) + " |" for k, v in sorted(rows.items())]
    return "\n".join(head + body)
