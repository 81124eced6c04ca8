"""The gate's rows and report, apart from the run that fills them: the
phases, the evidence and a fuzzing session's own check (``confirm``) all
write rows, and none of them should need the run that sequences them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from harness.gate import ledger as ledger_mod
from harness.gate.selfcheck import CanaryResult
from harness.gate.status import FAILING, ORDER
from harness.observation import BUG_CLASS, Divergence

SCHEMA = 1


@dataclass
class Row:
    status: str
    path: str
    detail: str
    bug: str | None = None
    signature: str | None = None
    source: str = ""  # "corpus FILE", "fuzz" or "selfcheck"
    case: dict[str, Any] | None = None
    divergence: dict[str, Any] | None = None
    upstream: str = ""
    # ``misuse``: a use the stack's docs do not support, silently wrong: its
    # status counts as any other's, and every report lists it apart.
    finding_class: str = BUG_CLASS


@dataclass
class GateReport:
    torch: str
    rows: list[Row] = field(default_factory=list)
    selfcheck: list[CanaryResult] = field(default_factory=list)
    examples: dict[str, int] = field(default_factory=dict)
    # Per path, fuzzed cases a wrong grad would have agreed on: run, never passed.
    unjudged: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    schema: int = SCHEMA
    packages: dict[str, str] = field(default_factory=dict)  # the training stacks installed: part of the verdict
    # Seconds per phase, in the order run: where a slow gate spends its time.
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return any(r.status in FAILING for r in self.rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "torch": self.torch,
            "packages": self.packages,
            "passed": not self.failed,
            "seconds": round(self.seconds, 2),
            "phases": {k: round(v, 2) for k, v in self.phases.items()},
            "examples": self.examples,
            "unjudged": self.unjudged,
            "counts": {s: sum(1 for r in self.rows if r.status == s) for s in ORDER},
            "rows": [asdict(r) for r in self.rows],
            "selfcheck": [asdict(c) for c in self.selfcheck],
        }


def classify(bug: ledger_mod.Site, version: str, reproduced: bool) -> str:
    """A bug's signature shown (``reproduced``) inside its range is known (to
    be confirmed by its workaround), past it a regression, before it a range
    that starts too late; never plain known outside the range."""
    rel = bug.relation(version)
    if reproduced:
        return {"in": "known", "after": "regression", "before": "range_wrong"}[rel]
    return {"in": "not_reproduced", "after": "fixed", "before": "fixed"}[rel]


def row_of(status: str, d: Divergence, bug: ledger_mod.Site | None, source: str) -> Row:
    return Row(status, d.path, d.detail, bug.id if bug else None, d.signature, source, d.case,
               {k: v for k, v in d.to_json().items() if k != "case"}, bug.upstream if bug else "", d.finding_class)
