"""The known-bug ledger: upstream bugs, where they show, the versions they affect.

``cases/ledger.json`` holds one entry per known bug: its id, a one-line
summary, the upstream report, the corpus cases that reproduce it, and its
places: each a path pattern with the torch (and training stack) versions
affected there, the workaround that removes it there from outside and the
signatures its divergences were seen with there. One bug, one entry: a bug
seen through several families is one id with several places, never several
entries that each restate its summary (the docs count bugs from this file).
A bug seen on one set of paths may write its one place inline (``path``,
``torch``, ... beside ``id``), which keeps the common entry one flat object.
The gate classifies every result against a bug at the place covering the
result's path (a ``Site``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from packaging.version import InvalidVersion, Version

from harness.materialize import probes, workarounds
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
class Place:
    """Where a bug shows: the paths, and what holds for the bug on them."""

    path: str  # a path name, a pattern (``pipeline.*.stock``) or several, comma-separated
    torch: str  # affected versions, e.g. "<2.13" or ">=2.11"
    # A training stack's affected releases, besides torch's (``{"deepspeed": ">=0.16,<0.18"}``).
    packages: tuple[tuple[str, str], ...] = ()
    # What a user does from outside to avoid the bug here, by name (``harness.paths.workarounds``);
    # ``none``: nothing can be done from outside (upgrade torch).
    workaround: str = NO_WORKAROUND
    # ``workaround``: the bug's signatures depend on the case's numbers (tensors
    # swapped between microbatches), so the recorded ones cannot be complete;
    # the gate files a new divergence on these paths under it when its workaround
    # removes it (``harness.gate.known.claim_new``). ``signature``: by signature only.
    claims: str = "signature"
    signatures: tuple[str, ...] = ()
    cases: tuple[str, ...] = ()  # cases that show it on these paths only, besides the bug's own
    note: str = ""  # what is particular to these paths (a mechanism, where it was seen)
    # Where no workaround exists: the fix probe (``harness.materialize.probes``)
    # whose in-process patch removes exactly this bug, so the gate still checks
    # "known" causally; or, where none can be written, why not (``no_probe``).
    probe: str = ""
    no_probe: str = ""


@dataclass(frozen=True)
class Bug:
    """One known bug: one id, however many families show it."""

    id: str
    summary: str
    places: tuple[Place, ...]
    upstream: str = ""
    cases: tuple[str, ...] = ()  # corpus files, relative to the ledger, that show it at every place
    # ``misuse``: a use the stack's docs do not support that it silently gets
    # wrong (harness.observation.FINDING_CLASSES); listed apart in reports.
    finding_class: str = BUG_CLASS

    @classmethod
    def single(cls, bug_id: str, path: str, torch: str, summary: str, **place: Any) -> Bug:
        """A bug seen on one set of paths (the entry that writes its place inline)."""
        return cls(bug_id, summary, (Place(path, torch, **place),))

    @property
    def sites(self) -> tuple[Site, ...]:
        return tuple(Site(self, p) for p in self.places)

    def covers(self, path: str) -> bool:
        return any(covers(p.path, path) for p in self.places)

    def at(self, path: str) -> Site | None:
        """The bug at the first place covering ``path``, or None."""
        return next((s for s in self.sites if s.covers(path)), None)

    @property
    def path(self) -> str:
        """Every place's paths, comma-separated (a pattern ``covers`` reads)."""
        return ", ".join(p.path for p in self.places)

    @property
    def signatures(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s for p in self.places for s in p.signatures))

    @property
    def all_cases(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.cases, *(c for p in self.places for c in p.cases))))

    @property
    def range(self) -> str:
        """The affected ranges, one per distinct range of its places: ``torch >=2.11``."""
        return "; ".join(dict.fromkeys(s.range for s in self.sites))


@dataclass(frozen=True)
class Site:
    """A bug at one of its places: what a result on a path is classified
    against (its range, workaround and signatures are the place's)."""

    bug: Bug
    place: Place

    @property
    def id(self) -> str:
        return self.bug.id

    @property
    def path(self) -> str:
        return self.place.path

    @property
    def torch(self) -> str:
        return self.place.torch

    @property
    def packages(self) -> tuple[tuple[str, str], ...]:
        return self.place.packages

    @property
    def workaround(self) -> str:
        return self.place.workaround

    @property
    def claims(self) -> str:
        return self.place.claims

    @property
    def probe(self) -> str:
        return self.place.probe

    @property
    def no_probe(self) -> str:
        return self.place.no_probe

    @property
    def check(self) -> str:
        """What the gate runs to confirm "known": the workaround, else the fix probe, else ``none``."""
        if self.place.workaround != NO_WORKAROUND:
            return self.place.workaround
        return self.place.probe or NO_WORKAROUND

    @property
    def signatures(self) -> tuple[str, ...]:
        return self.place.signatures

    @property
    def cases(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.bug.cases, *self.place.cases)))

    @property
    def summary(self) -> str:
        return f"{self.bug.summary} ({self.place.note})" if self.place.note else self.bug.summary

    @property
    def upstream(self) -> str:
        return self.bug.upstream

    @property
    def finding_class(self) -> str:
        return self.bug.finding_class

    def covers(self, path: str) -> bool:
        return covers(self.place.path, path)

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

    @property
    def sites(self) -> list[Site]:
        """Every bug at every place, in ledger order."""
        return [s for b in self.bugs for s in b.sites]

    def bug(self, bug_id: str) -> Bug:
        """The bug of ``bug_id`` (KeyError when the ledger has none)."""
        found = next((b for b in self.bugs if b.id == bug_id), None)
        if found is None:
            raise KeyError(bug_id)
        return found

    def for_path(self, path: str) -> list[Site]:
        return [s for s in self.sites if s.covers(path)]

    def match(self, path: str, signature: str, case_file: str | None = None, version: str | None = None) -> Site | None:
        """The bug a divergence belongs to. Coarse signatures can fit several
        bugs of one path; then a bug affecting ``version`` wins."""
        hits = [s for s in self.for_path(path) if signature in s.signatures or case_file and self.is_case_of(s, case_file)]
        return first(hits, version)

    def by_id(self, bug_id: str, path: str) -> Site:
        """Bug ``bug_id`` at its first place covering ``path``."""
        return next(s for s in self.sites if s.id == bug_id and s.covers(path))

    def is_case_of(self, site: Site | Bug, file: str) -> bool:
        """Whether corpus ``file`` is one of ``site``'s cases (listed relative to the ledger)."""
        cases = site.cases if isinstance(site, Site) else site.all_cases
        return any(os.path.abspath(os.path.join(self.root, c)) == os.path.abspath(file) for c in cases)


def first(hits: list[Site], version: str | None) -> Site | None:
    """Of the bugs a divergence fits, the one affecting ``version`` (coarse
    signatures and shapes can fit several bugs of one path)."""
    if version is not None:
        hits = sorted(hits, key=lambda b: {"in": 0, "before": 1, "after": 2}[b.relation(version)])
    return hits[0] if hits else None


_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# A place's fields; a bug with one place may write them inline, beside its own.
PLACE_FIELDS = ("path", "torch", "packages", "workaround", "probe", "no_probe", "claims", "signatures", "cases", "note")
_INLINE_FIELDS = ("path", "torch", "packages", "workaround", "probe", "no_probe", "claims", "signatures")
_BUG_FIELDS = ("id", "summary", "upstream", "cases", "finding_class", "places")
CLAIMS = ("signature", "workaround")
MAX_BUGS = 10_000
MAX_PLACES = 64
MAX_CASES = 256
MAX_SIGNATURES = 1024


def _case_file(v: Any, where: str) -> str:
    """A corpus file relative to the ledger, never outside the ledger's folder."""
    sc.string(v, where, max_len=512, empty=False)
    if os.path.isabs(v) or ".." in v.replace("\\", "/").split("/") or "\0" in v:
        raise SpecError(where, f"{v[:60]!r} must be a path relative to the ledger, inside its folder")
    return v


def _cases(v: Any, where: str) -> tuple[str, ...]:
    return tuple(_case_file(c, f"{where}[{j}]") for j, c in enumerate(sc.array(v, where, MAX_CASES)))


def _place(p: dict[str, Any], where: str) -> Place:
    """One place, its fields checked (``where`` names the object holding them)."""
    sc.string(p["path"], f"{where}.path", max_len=256, empty=False)
    sc.version_range(p["torch"], f"{where}.torch")
    packages = tuple(sorted(sc.package_ranges(p.get("packages", {}), f"{where}.packages").items()))
    wa = sc.string(p.get("workaround", NO_WORKAROUND), f"{where}.workaround",
                   choices=(NO_WORKAROUND, *workarounds.WORKAROUNDS))
    probe = sc.string(p.get("probe", ""), f"{where}.probe", choices=("", *probes.PROBES))
    no_probe = sc.string(p.get("no_probe", ""), f"{where}.no_probe", max_len=sc.MAX_TEXT)
    if probe and no_probe:
        raise SpecError(f"{where}.no_probe", "a place with a fix probe cannot also say why it has none")
    claims = sc.string(p.get("claims", CLAIMS[0]), f"{where}.claims", choices=CLAIMS)
    if claims == "workaround" and wa == NO_WORKAROUND and not probe:
        raise SpecError(f"{where}.claims", "claims \"workaround\" needs a workaround or a fix probe: the gate "
                        "files a new divergence under this bug only where that check removes it")
    sigs = tuple(sc.signature(x, f"{where}.signatures[{j}]")
                 for j, x in enumerate(sc.array(p.get("signatures", []), f"{where}.signatures", MAX_SIGNATURES)))
    return Place(p["path"], p["torch"], packages, wa, claims, sigs, _cases(p.get("cases", []), f"{where}.cases"),
                 sc.string(p.get("note", ""), f"{where}.note", max_len=sc.MAX_TEXT), probe, no_probe)


def _bug(b: Any, where: str) -> Bug:
    """One entry: a bug, with its places in ``places`` or its one place inline."""
    sc.obj(b, where, ("id", "summary"), (*_BUG_FIELDS, *_INLINE_FIELDS))
    sc.string(b["id"], f"{where}.id", max_len=128, pattern=_ID)
    sc.string(b["summary"], f"{where}.summary", max_len=sc.MAX_TEXT)
    sc.string(b.get("upstream", ""), f"{where}.upstream", max_len=sc.MAX_TEXT)
    cls = corpus_finding_class(b.get("finding_class", BUG_CLASS), f"{where}.finding_class")
    cases = _cases(b.get("cases", []), f"{where}.cases")
    inline = [k for k in _INLINE_FIELDS if k in b]
    if "places" in b:
        if inline:
            raise SpecError(f"{where}.{inline[0]}", "this bug lists its places in places: move "
                            f"{', '.join(inline)} into the place they belong to")
        places = []
        for k, p in enumerate(sc.array(b["places"], f"{where}.places", MAX_PLACES)):
            sc.obj(p, f"{where}.places[{k}]", ("path", "torch"), PLACE_FIELDS)
            places.append(_place(p, f"{where}.places[{k}]"))
        if not places:
            raise SpecError(f"{where}.places", "no place: a bug shows on at least one path (path and torch)")
    else:
        for k in ("path", "torch"):
            if k not in b:
                raise SpecError(f"{where}.{k}", "missing field (a bug names where it shows: path and torch inline, "
                                "or a list of places)")
        places = [_place(b, where)]
    seen: dict[str, int] = {}
    for k, p in enumerate(places):
        if p.path in seen:
            raise SpecError(f"{where}.places[{k}].path", f"{p.path!r} is places[{seen[p.path]}]'s path too: "
                            "merge the two places")
        seen[p.path] = k
    return Bug(b["id"], b["summary"], tuple(places), b.get("upstream", ""), cases, cls)


def from_json(data: Any, file: str) -> Ledger:
    """A parsed ledger -> Ledger, every field checked; FileError naming the file and field."""
    try:
        sc.obj(data, "", ("gradfuzz_ledger", "bugs"), ("gradfuzz_ledger", "signature_scheme", "bugs"))
        v = data["gradfuzz_ledger"]
        if type(v) is not int or v != LEDGER_VERSION:
            raise SpecError("gradfuzz_ledger", f"expected {LEDGER_VERSION}, got {sc._show(v)}")
        _scheme(data.get("signature_scheme", 1))
        bugs: list[Bug] = []
        ids: dict[str, int] = {}
        for i, b in enumerate(sc.array(data["bugs"], "bugs", MAX_BUGS)):
            bug = _bug(b, f"bugs[{i}]")
            if bug.id in ids:  # one entry per bug
                raise SpecError(f"bugs[{i}].id", f"{bug.id!r} is bugs[{ids[bug.id]}]'s id too: a bug is one entry; "
                                f"add this entry's paths to bugs[{ids[bug.id]}] as places (or give it an id of its own)")
            ids[bug.id] = i
            bugs.append(bug)
    except SpecError as e:
        if not e.where:
            raise CorpusError(file, "expected a JSON object with gradfuzz_ledger and bugs") from None
        raise CorpusError(file, f"field {e}") from None
    return Ledger(bugs, os.path.dirname(os.path.abspath(file)))


def places_of(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The place objects of one entry as the file holds them (the entry
    itself when its one place is inline): where a tool that edits the file
    in place (``gradfuzz ledger --write``) records a place's signatures."""
    places = entry.get("places")
    return [p for p in places if isinstance(p, dict)] if isinstance(places, list) else [entry]


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
                                             "packages", "phases", "unjudged"))
        sc.dict_of(data.get("phases", {}), "phases", lambda x, w: sc.number(x, w, 0.0, 1e9), max_items=16)
        for k in ("examples", "unjudged"):
            sc.dict_of(data.get(k, {}), k, lambda x, w: sc.integer(x, w, 0, 10**12), max_items=10_000)
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
    """An entry as the ledger file holds it: one place inline, several in
    ``places``; defaults left out (no ``packages`` for a torch-only bug, no
    ``finding_class`` for a bug of the default class)."""
    head: dict[str, Any] = {"id": bug.id}
    tail: dict[str, Any] = {"summary": bug.summary, "upstream": bug.upstream}
    if bug.finding_class != BUG_CLASS:
        tail["finding_class"] = bug.finding_class
    if len(bug.places) == 1 and not bug.places[0].note:
        (p,) = bug.places
        place = _place_json(p)
        cases = list(dict.fromkeys((*bug.cases, *place.pop("cases", []))))
        head.update(path=place.pop("path"), torch=place.pop("torch"))
        return {**head, **tail, "cases": cases, **place}
    return {**head, **tail, **({"cases": list(bug.cases)} if bug.cases else {}),
            "places": [_place_json(p) for p in bug.places]}


def _place_json(p: Place) -> dict[str, Any]:
    out: dict[str, Any] = {"path": p.path, "torch": p.torch}
    if p.packages:
        out["packages"] = dict(p.packages)
    if p.note:
        out["note"] = p.note
    if p.cases:
        out["cases"] = list(p.cases)
    out["signatures"] = list(p.signatures)
    out["workaround"] = p.workaround
    if p.probe:
        out["probe"] = p.probe
    if p.no_probe:
        out["no_probe"] = p.no_probe
    if p.claims != CLAIMS[0]:
        out["claims"] = p.claims
    return out


def signature_label(bug: Site | None, version: str) -> str:
    """What a signature match alone may say: a fuzzing front does not run the
    workaround, so it never says plain "known" (the gate decides that)."""
    if bug is None:
        return "not in ledger"
    return {"in": f"resembles {bug.id} (signature; `gradfuzz gate` checks its workaround)",
            "after": f"regression? {bug.id} (fixed in its range {bug.range})",
            "before": f"range wrong? {bug.id} (its range {bug.range} starts later)"}[bug.relation(version)]


def settled_by(led: Ledger, version: str) -> Callable[[str, str], bool]:
    """``settled(path, signature)``: the ledger places the signature on the
    path, in its range here. The gate keeps such a first hit as drawn instead
    of shrinking it: the row is judged on that case either way, the ledger's
    own cases are the small ones, and every shrink step of a compile path
    compiles again (minutes per hit on a cold cache)."""

    def settled(path: str, signature: str) -> bool:
        site = led.match(path, signature, version=version)
        return site is not None and site.relation(version) == "in"

    return settled


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


def doc_row(bug: Bug) -> str:
    """The bug's row in docs/ledger.md's tables (a test keeps the page's rows
    equal to these): id, every place's paths, the torch ranges, and the stack
    ranges in bold before the summary."""
    ranges = "; ".join(dict.fromkeys(p.torch for p in bug.places))
    stacks = "; ".join(dict.fromkeys(", ".join(f"{n} {s}" for n, s in p.packages) for p in bug.places if p.packages))
    what = f"**{stacks}**: {bug.summary}" if stacks else bug.summary
    return f"| `{bug.id}` | `{bug.path}` | `{ranges}` | {what} |"


def counts(ledger: Ledger) -> dict[str, int]:
    """What the docs say about the ledger's size, counted from it: entries
    (one per bug), bugs, misuses and places."""
    misuses = sum(b.finding_class != BUG_CLASS for b in ledger.bugs)
    return {"entries": len(ledger.bugs), "bugs": len(ledger.bugs) - misuses, "misuses": misuses,
            "places": len(ledger.sites)}
