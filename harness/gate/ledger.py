"""The known-bug ledger: upstream bugs, the torch versions they affect.

``cases/ledger.json`` holds one entry per known bug and path: the corpus
cases that reproduce it, the signatures its divergences were seen with, a
version range (a PEP 440 specifier, possibly open-ended), the upstream
report and a one-line summary. The gate classifies every result against it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from harness.out.corpus import CorpusError, covers

LEDGER_VERSION = 1


@dataclass(frozen=True)
class Bug:
    id: str
    path: str
    torch: str  # affected versions, e.g. "<2.13" or ">=2.11"
    summary: str
    upstream: str = ""
    cases: tuple[str, ...] = ()  # corpus files, relative to the ledger
    signatures: tuple[str, ...] = ()

    def covers(self, path: str) -> bool:
        return covers(self.path, path)

    def relation(self, version: str) -> str:
        """``in`` the affected range, ``after`` it (fixed since) or ``before`` it."""
        v = Version(version.split("+")[0])
        spec = SpecifierSet(self.torch, prereleases=True)
        if v in spec:
            return "in"
        uppers = [Version(s.version) for s in spec if s.operator in ("<", "<=")]
        return "after" if uppers and any(v >= u for u in uppers) else "before"


@dataclass
class Ledger:
    bugs: list[Bug] = field(default_factory=list)
    root: str = ""

    def for_path(self, path: str) -> list[Bug]:
        return [b for b in self.bugs if b.covers(path)]

    def match(self, path: str, signature: str, case_file: str | None = None, version: str | None = None) -> Bug | None:
        """The bug a divergence belongs to. Coarse signatures can fit several
        bugs of one path; then a bug affecting ``version`` wins."""
        hits = [
            b for b in self.for_path(path)
            if signature in b.signatures
            or case_file and any(os.path.abspath(os.path.join(self.root, c)) == os.path.abspath(case_file) for c in b.cases)
        ]
        return first(hits, version)


def first(hits: list[Bug], version: str | None) -> Bug | None:
    """Of the bugs a divergence fits, the one affecting ``version`` (coarse
    signatures and shapes can fit several bugs of one path)."""
    if version is not None:
        hits = sorted(hits, key=lambda b: {"in": 0, "before": 1, "after": 2}[b.relation(version)])
    return hits[0] if hits else None


def load(file: str) -> Ledger:
    try:
        data = json.loads(open(file).read())
    except OSError as e:
        raise CorpusError(file, f"cannot read ledger: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise CorpusError(file, f"ledger is not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(data, dict) or data.get("gradfuzz_ledger") != LEDGER_VERSION:
        raise CorpusError(file, f"field gradfuzz_ledger: expected {LEDGER_VERSION}, got {data.get('gradfuzz_ledger') if isinstance(data, dict) else data!r}")
    bugs = []
    for i, b in enumerate(data.get("bugs", [])):
        where = f"bugs[{i}]"
        missing = [k for k in ("id", "path", "torch", "summary") if k not in b]
        if missing:
            raise CorpusError(file, f"field {where}.{missing[0]}: missing")
        try:
            SpecifierSet(b["torch"])
        except InvalidSpecifier as e:
            raise CorpusError(file, f"field {where}.torch: {e}") from None
        unknown = set(b) - {"id", "path", "torch", "summary", "upstream", "cases", "signatures"}
        if unknown:
            raise CorpusError(file, f"field {where}.{sorted(unknown)[0]}: unknown field")
        bugs.append(Bug(**{**b, "cases": tuple(b.get("cases", ())), "signatures": tuple(b.get("signatures", ()))}))
    return Ledger(bugs, os.path.dirname(os.path.abspath(file)))


def to_json(ledger: Ledger) -> dict[str, Any]:
    return {
        "gradfuzz_ledger": LEDGER_VERSION,
        "bugs": [{k: list(v) if isinstance(v, tuple) else v for k, v in b.__dict__.items()} for b in ledger.bugs],
    }
