"""The known-bug ledger: upstream bugs, the torch versions they affect.

``cases/ledger.json`` holds one entry per known bug and path: the corpus
cases that reproduce it, the signatures its divergences were seen with, a
version range (a PEP 440 specifier, possibly open-ended), the upstream
report and a one-line summary. The gate classifies every result against it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from packaging.version import InvalidVersion, Version

from harness.materialize import workarounds
from harness.case import schema as sc
from harness.case.spec import SpecError
from harness.artifacts.corpus import CorpusError, covers, relation
from harness.artifacts.corpus import finding_class as corpus_finding_class
from harness.gate.status import STATUSES
from harness.observation import BUG_CLASS, SIGNATURE_SCHEME

LEDGER_VERSION = 1
# An entry's ``workaround`` when none exists from outside: its findings are
# "known by signature only", shown apart in every report.
NO_WORKAROUND = "none"


@dataclass(frozen=True)
class Bug:
    id: str
    path: str
    torch: str  # affected versions, e.g. "<2.13" or ">=2.11"
    summary: str
    upstream: str = ""
    cases: tuple[str, ...] = ()  # corpus files, relative to the ledger
    signatures: tuple[str, ...] = ()
    # What a user does from outside to avoid the bug, by name (``harness.paths.workarounds``);
    # ``none``: nothing can be done from outside (upgrade torch).
    workaround: str = NO_WORKAROUND
    # A training stack's affected releases, besides torch's (``{"deepspeed": ">=0.16,<0.18"}``).
    packages: tuple[tuple[str, str], ...] = ()
    # ``misuse``: a use the stack's docs do not support that it silently gets
    # wrong (harness.observation.FINDING_CLASSES); listed apart in reports.
    finding_class: str = BUG_CLASS
    # ``workaround``: the bug's signatures depend on the case's numbers (tensors
    # swapped between microbatches), so the recorded ones cannot be complete;
    # the gate files a new divergence on its path under it when its workaround
    # removes it (``harness.gate.run.claim_new``). ``signature``: by signature only.
    claims: str = "signature"

    def covers(self, path: str) -> bool:
        return covers(self.path, path)

    def relation(self, version: str) -> str:
        """``in`` the affected range (torch ``version`` and the stacks
        installed here), ``after`` it (fixed since) or ``before`` it."""
        return relation(self.torch, dict(self.packages), version)

    @property
    def range(self) -> str:
        """The affected range as one line: ``torch <2.13`` or ``torch >=2.11, deepspeed >=0.16``."""
        return ", ".join(f"{name} {spec or 'any'}" for name, spec in (("torch", self.torch), *self.packages))


@dataclass
class Ledger:
    bugs: list[Bug] = field(default_factory=list)
    root: str = ""

    def for_path(self, path: str) -> list[Bug]:
        return [b for b in self.bugs if b.covers(path)]

    def match(self, path: str, signature: str, case_file: str | None = None, version: str | None = None) -> Bug | None:
        """The bug a divergence belongs to. Coarse signatures can fit several
        bugs of one path; then a bug affecting ``version`` wins."""
        hits = [b for b in self.for_path(path) if signature in b.signatures or case_file and self.is_case_of(b, case_file)]
        return first(hits, version)

    def by_id(self, bug_id: str, path: str) -> Bug:
        """The entry for ``bug_id`` that covers ``path`` (one entry per bug and path)."""
        return next(b for b in self.bugs if b.id == bug_id and b.covers(path))

    def is_case_of(self, bug: Bug, file: str) -> bool:
        """Whether corpus ``file`` is one of ``bug``'s cases (listed relative to the ledger)."""
        return any(os.path.abspath(os.path.join(self.root, c)) == os.path.abspath(file) for c in bug.cases)


def first(hits: list[Bug], version: str | None) -> Bug | None:
    """Of the bugs a divergence fits, the one affecting ``version`` (coarse
    signatures and shapes can fit several bugs of one path)."""
    if version is not None:
        hits = sorted(hits, key=lambda b: {"in": 0, "before": 1, "after": 2}[b.relation(version)])
    return hits[0] if hits else None


_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_BUG_FIELDS = ("id", "path", "torch", "packages", "summary", "upstream", "cases", "signatures", "workaround",
               "finding_class", "claims")
CLAIMS = ("signature", "workaround")
MAX_BUGS = 10_000


def _case_file(v: Any, where: str) -> str:
    """A corpus file relative to the ledger, never outside the ledger's folder."""
    sc.string(v, where, max_len=512, empty=False)
    if os.path.isabs(v) or ".." in v.replace("\\", "/").split("/") or "\0" in v:
        raise SpecError(where, f"{v[:60]!r} must be a path relative to the ledger, inside its folder")
    return v


def from_json(data: Any, file: str) -> Ledger:
    """A parsed ledger -> Ledger, every field checked; FileError naming the file and field."""
    try:
        sc.obj(data, "", ("gradfuzz_ledger", "bugs"), ("gradfuzz_ledger", "signature_scheme", "bugs"))
        v = data["gradfuzz_ledger"]
        if type(v) is not int or v != LEDGER_VERSION:
            raise SpecError("gradfuzz_ledger", f"expected {LEDGER_VERSION}, got {sc._show(v)}")
        _scheme(data.get("signature_scheme", 1))
        bugs, ids = [], set()
        for i, b in enumerate(sc.array(data["bugs"], "bugs", MAX_BUGS)):
            where = f"bugs[{i}]"
            sc.obj(b, where, ("id", "path", "torch", "summary"), _BUG_FIELDS)
            sc.string(b["id"], f"{where}.id", max_len=128, pattern=_ID)
            sc.string(b["path"], f"{where}.path", max_len=256, empty=False)
            if (b["id"], b["path"]) in ids:  # one entry per bug and path
                raise SpecError(f"{where}.id", f"{b['id']!r} on {b['path']!r} is filed by an earlier entry too")
            ids.add((b["id"], b["path"]))
            sc.version_range(b["torch"], f"{where}.torch")
            packages = tuple(sorted(sc.package_ranges(b.get("packages", {}), f"{where}.packages").items()))
            sc.string(b["summary"], f"{where}.summary", max_len=sc.MAX_TEXT)
            sc.string(b.get("upstream", ""), f"{where}.upstream", max_len=sc.MAX_TEXT)
            cases = tuple(_case_file(c, f"{where}.cases[{j}]") for j, c in enumerate(sc.array(b.get("cases", []), f"{where}.cases")))
            sigs = tuple(sc.signature(x, f"{where}.signatures[{j}]")
                         for j, x in enumerate(sc.array(b.get("signatures", []), f"{where}.signatures", 1024)))
            wa = sc.string(b.get("workaround", NO_WORKAROUND), f"{where}.workaround",
                           choices=(NO_WORKAROUND, *workarounds.EFFECTS))
            cls = corpus_finding_class(b.get("finding_class", BUG_CLASS), f"{where}.finding_class")
            claims = sc.string(b.get("claims", CLAIMS[0]), f"{where}.claims", choices=CLAIMS)
            if claims == "workaround" and wa == NO_WORKAROUND:
                raise SpecError(f"{where}.claims", "claims \"workaround\" needs a workaround other than \"none\": "
                                "the gate files a new divergence under this bug only where its workaround removes it")
            bugs.append(Bug(**{**b, "cases": cases, "signatures": sigs, "workaround": wa, "packages": packages,
                               "finding_class": cls, "claims": claims}))
    except SpecError as e:
        if not e.where:
            raise CorpusError(file, "expected a JSON object with gradfuzz_ledger and bugs") from None
        raise CorpusError(file, f"field {e}") from None
    return Ledger(bugs, os.path.dirname(os.path.abspath(file)))


def _scheme(v: Any) -> None:
    """Signatures are hashes of what the scheme puts in them: one recorded
    under another scheme can never match, so the whole ledger is refused."""
    if type(v) is not int or v != SIGNATURE_SCHEME:
        raise SpecError("signature_scheme", f"the ledger's signatures were recorded under scheme {sc._show(v)}; this "
                        f"gradfuzz computes scheme {SIGNATURE_SCHEME}: re-record them with `gradfuzz ledger --rescheme` "
                        "(replays each entry's cases and records what they show here)")


def load(file: str) -> Ledger:
    """The known-bug ledger, checked whole before the gate does anything."""
    return from_json(sc.read_json(file, sc.MAX_LEDGER_BYTES, "ledger"), file)


# --- gate reports (``gate --baseline``, ``gradfuzz table``) ---------------------------

REPORT_STATUSES = tuple(STATUSES)
_ROW_FIELDS = ("status", "path", "detail", "bug", "signature", "source", "case", "divergence", "upstream",
               "finding_class")


def _version(v: Any, where: str) -> str:
    sc.string(v, where, max_len=64, empty=False)
    try:
        Version(v.split("+")[0])
    except InvalidVersion:
        raise SpecError(where, f"{v!r} is not a torch version") from None
    return v


def report_from_json(data: Any, file: str) -> dict[str, Any]:
    """A gate report another run wrote: the fields ``table`` and ``--baseline`` use, checked."""
    try:
        sc.obj(data, "", ("torch", "rows"), ("schema", "passed", "seconds", "examples", "counts", "selfcheck",
                                             "packages", "phases"))
        sc.dict_of(data.get("phases", {}), "phases", lambda x, w: sc.number(x, w, 0.0, 1e9), max_items=16)
        if "schema" in data:
            sc.integer(data["schema"], "schema", 1, 1)
        _version(data["torch"], "torch")
        # The releases installed where the report was made (``{"deepspeed": "0.19.8"}``): versions, not ranges.
        for name, release in sc.dict_of(data.get("packages", {}), "packages", lambda x, w: x, 8).items():
            sc.string(name, "packages key", max_len=64, pattern=sc._PACKAGE)
            _version(release, f"packages.{name}")
        opt_text = lambda x, w: x if x is None else sc.string(x, w, max_len=sc.MAX_TEXT)  # noqa: E731
        for i, row in enumerate(sc.array(data["rows"], "rows", 100_000)):
            w = f"rows[{i}]"
            sc.obj(row, w, ("status", "path", "detail", "bug", "signature"), _ROW_FIELDS)
            sc.string(row["status"], f"{w}.status", choices=REPORT_STATUSES)
            sc.string(row["path"], f"{w}.path", max_len=256)
            sc.string(row["detail"], f"{w}.detail", max_len=sc.MAX_TEXT)
            for k in ("bug", "signature", "source", "upstream"):
                opt_text(row.get(k), f"{w}.{k}")
            corpus_finding_class(row.get("finding_class", BUG_CLASS), f"{w}.finding_class")
            for k in ("case", "divergence"):
                if row.get(k) is not None:
                    sc.obj(row[k], f"{w}.{k}", open_keys=True)
    except SpecError as e:
        if not e.where:
            raise CorpusError(file, "expected a gate report (a JSON object with torch and rows)") from None
        raise CorpusError(file, f"field {e}") from None
    return data


def load_report(file: str) -> dict[str, Any]:
    return report_from_json(sc.read_json(file, sc.MAX_REPORT_BYTES, "gate report"), file)


def to_json(ledger: Ledger) -> dict[str, Any]:
    return {
        "gradfuzz_ledger": LEDGER_VERSION,
        "signature_scheme": SIGNATURE_SCHEME,
        "bugs": [_entry(b) for b in ledger.bugs],
    }


def _entry(bug: Bug) -> dict[str, Any]:
    """An entry as the ledger file holds it (no ``packages`` for a torch-only
    bug, no ``finding_class`` for a bug of the default class)."""
    out = {k: list(v) if isinstance(v, tuple) else v for k, v in bug.__dict__.items()}
    if out["finding_class"] == BUG_CLASS:
        del out["finding_class"]
    if out["claims"] == CLAIMS[0]:
        del out["claims"]
    packages = out.pop("packages")
    return {**out, "packages": dict(packages)} if packages else out


def signature_label(bug: Bug | None, version: str) -> str:
    """What a signature match alone may say: a fuzzing front does not run the
    workaround, so it never says plain "known" (the gate decides that)."""
    if bug is None:
        return "not in ledger"
    return {"in": f"resembles {bug.id} (signature; `gradfuzz gate` checks its workaround)",
            "after": f"regression? {bug.id} (fixed in its range {bug.range})",
            "before": f"range wrong? {bug.id} (its range {bug.range} starts later)"}[bug.relation(version)]


def labeller(file: str | None = None):
    """``label(path, signature)`` for fuzzing fronts (``signature_label``). The
    ledger is read once. ``file`` None: the installed project's ledger
    (``harness.project``); a ledger that is not there is a UsageError, never
    an empty one that would call every known bug "not in ledger"."""
    import torch

    from harness import project

    led = load(project.ledger_file(file))
    version = torch.__version__

    def label(path: str, signature: str) -> str:
        return signature_label(led.match(path, signature, version=version), version)

    return label
