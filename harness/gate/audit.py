"""Is the ledger true on this torch? Each entry's own cases, replayed.

The gate files a fuzzed divergence under a bug by its signature; ``fuzz``
and the pytest plugin label findings by the signatures an entry records. A
signature recorded under the wrong entry files a new bug as an old one (or
an old one as NEW, as happened to a two-rank zero-bubble finding), so the
ledger is checked against its own evidence: every entry's cases are
replayed on every path the entry covers that runs here, and

- ``unrecorded``: a signature its own case shows that no entry records
  (``--write`` records it, so ``fuzz`` labels it ``known``; ``--write``
  also records a misfiled one beside the entries whose cases show it);
- ``misfiled``: a signature some entry's cases show is recorded only under
  entries whose own cases, replayed here, do not show it;
- ``silent``: the torch here is in the entry's range, yet none of its
  cases diverges on any covered path that runs here.

Entries whose paths do not run here (no GPU, no second rank) are skipped
and named, never counted as consistent.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from harness.engine.check import replay_entries
from harness.gate import ledger as ledger_mod
from harness.artifacts import corpus
from harness.paths import Path


@dataclass
class Problem:
    kind: str  # "unrecorded", "misfiled", "silent"
    bug: str
    path: str
    signature: str = ""
    detail: str = ""


@dataclass
class Audit:
    problems: list[Problem] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)  # "id on path-pattern" replayed on at least one path
    skipped: dict[str, str] = field(default_factory=dict)  # "id on path-pattern" -> why not checked here
    replays: int = 0
    # Signatures several entries' cases show and none records: a coarse
    # signature two bugs share; left unrecorded (which bug a fuzzed one is
    # cannot be told from it), listed for a person.
    shared: list[Problem] = field(default_factory=list)

    def failing(self, *, wrote: bool = False) -> list[Problem]:
        return [p for p in self.problems if not (wrote and p.kind in ("unrecorded", "misfiled"))]


def audit(ledger_file: str, paths: list[Path], version: str, only: set[str] | None = None) -> Audit:
    """Replay every entry's cases (``only``: these entry ids) on the live ``paths`` it covers."""
    led = ledger_mod.load(ledger_file)
    out = Audit()
    seen_by: dict[str, dict[str, tuple[str, str]]] = {}  # signature -> entry id -> (path, detail)
    checked: dict[str, ledger_mod.Site] = {}
    for b in led.sites:
        if only is not None and b.id not in only:
            continue
        entry = f"{b.id} on {b.path}"
        covered = [p for p in paths if b.covers(p.name)]
        if not covered:
            out.skipped[entry] = f"no path matching {b.path!r} runs here"
            continue
        if not b.cases:
            out.skipped[entry] = "the entry lists no cases"
            continue
        entries = [corpus.load(os.path.join(led.root, c)) for c in b.cases]
        ran = shown = False
        for r in replay_entries(entries, covered):
            if r.skipped is not None:
                continue
            ran = True
            out.replays += 1
            for d in r.divergences:
                shown = True
                seen_by.setdefault(d.signature, {}).setdefault(b.id, (d.path, d.detail))
        if not ran:
            out.skipped[entry] = "its cases are outside the contract of every covered path here"
            continue
        out.checked.append(entry)
        checked[b.id] = b
        if b.relation(version) == "in" and not shown and not any(
                x.id == b.id and x is not b and x.relation(version) == "in" for x in checked.values()):
            out.problems.append(Problem("silent", b.id, b.path, detail=f"torch {version} is in {b.range}, "
                                        f"yet none of {len(b.cases)} case(s) diverges on {len(covered)} covered path(s)"))
    _file_signatures(out, led, seen_by, checked, version)
    return out


def _file_signatures(out: Audit, led: ledger_mod.Ledger, seen_by: dict[str, dict[str, tuple[str, str]]],
                     checked: dict[str, ledger_mod.Site], version: str) -> None:
    """Each signature the replay showed, against the entries that record it:
    recorded where its cases show it, misfiled, unrecorded, or shared."""
    recorded: dict[str, set[str]] = {}
    for b in led.sites:
        for s in b.signatures:
            recorded.setdefault(s, set()).add(b.id)
    for sig, by in sorted(seen_by.items()):
        owners = recorded.get(sig, set())
        path, detail = next(iter(by.values()))
        if owners & set(by):
            continue  # recorded under an entry whose own case shows it
        if owners:
            # Recorded only under entries whose cases, replayed here, do not show it.
            # (An owner whose cases did not run here may show it on another torch.)
            wrong = sorted(o for o in owners if o in checked or not led.bug(o).all_cases)
            if wrong:
                out.problems.append(Problem("misfiled", ", ".join(sorted(by)), path, sig,
                                            f"recorded under {', '.join(wrong)}, whose cases do not show it here; "
                                            f"the case(s) of {', '.join(sorted(by))} do: {detail[:160]}"))
            continue
        in_range = [i for i in by if checked[i].relation(version) == "in"]
        if len(by) == 1 and in_range:
            out.problems.append(Problem("unrecorded", in_range[0], path, sig, detail[:160]))
        elif len(by) > 1:
            out.shared.append(Problem("shared", ", ".join(sorted(by)), path, sig,
                                      f"shown by the cases of {len(by)} entries, recorded by none: {detail[:120]}"))


def rescheme(ledger_file: str) -> bool:
    """Move a ledger recorded under another signature scheme to this one: its
    signatures cannot be translated (they are hashes), so they are dropped and
    ``record`` re-records what each entry's cases show on this machine (run
    ``gradfuzz ledger --write`` on the other torch versions and machines too).
    False, and nothing written, when the ledger is already on this scheme."""
    from harness.case import schema as sc
    from harness.observation import SIGNATURE_SCHEME

    data = sc.read_json(ledger_file, sc.MAX_LEDGER_BYTES, "ledger")
    if isinstance(data, dict) and data.get("signature_scheme") == SIGNATURE_SCHEME:
        return False
    if isinstance(data, dict):
        data = {"gradfuzz_ledger": data.get("gradfuzz_ledger"), "signature_scheme": SIGNATURE_SCHEME,
                **{k: v for k, v in data.items() if k not in ("gradfuzz_ledger", "signature_scheme")}}
        for b in data.get("bugs") if isinstance(data.get("bugs"), list) else []:
            for place in ledger_mod.places_of(b) if isinstance(b, dict) else []:
                place["signatures"] = []
    ledger_mod.from_json(data, ledger_file)  # the rest of the file must be valid as it stands
    _write(ledger_file, data)
    return True


def _write(ledger_file: str, data: dict) -> None:
    tmp = f"{ledger_file}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, ledger_file)


def record(ledger_file: str, problems: list[Problem]) -> int:
    """Add each ``unrecorded`` or ``misfiled`` signature to the entries whose
    cases show it; the file keeps its layout otherwise. Returns how many were
    added."""
    from harness.case import schema as sc

    data = sc.read_json(ledger_file, sc.MAX_LEDGER_BYTES, "ledger")
    ledger_mod.from_json(data, ledger_file)  # the file as it stands must be a ledger before it is edited
    add: dict[tuple[str, str], list[str]] = {}
    for p in problems:
        # A misfiled signature is recorded beside the entries whose cases show
        # it, not moved: the other entry's cases may show it on another torch,
        # and of several matching entries the one affecting the torch wins.
        if p.kind in ("unrecorded", "misfiled"):
            for bug in p.bug.split(", "):
                add.setdefault((bug, p.path), []).append(p.signature)
    n = 0
    for b in data["bugs"]:
        for (bug, path), sigs in add.items():
            place = next((p for p in ledger_mod.places_of(b) if b["id"] == bug and ledger_mod.covers(p["path"], path)), None)
            if place is not None:  # the first place covering the path, as the gate matches
                have = place.setdefault("signatures", [])
                for s in sigs:
                    if s not in have:
                        have.append(s)
                        n += 1
    _write(ledger_file, data)
    return n
