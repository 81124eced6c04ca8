"""Whether a row the ledger fits is that bug: its case run again with the
bug's outside workaround, or its fix probe, in force.

A signature match alone says only "resembles": coarse signatures are shared
by bugs of one path, and a second bug of the same shape would read as the
first. The gate and a fuzzing session's own check (``confirm``) both settle
it here.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from harness.case.spec import Case
from harness.engine.check import CaseCheck
from harness.gate import ledger as ledger_mod
from harness.gate.evidence import Evidence
from harness.gate.rows import Row, row_of
from harness.materialize import probes
from harness.materialize.workarounds import WORKAROUNDS
from harness.observation import Divergence
from harness.paths import Path, in_child
from harness.paths.workarounds import WorkedAround, apply


def confirm_known(rows: list[Row], live: list[Path], evidence: Evidence, slack: float | None,
                  workers: int = 1) -> None:
    """"Known" is causal: each (bug, path, signature) row the ledger would call
    known is run again with the bug's outside workaround in force. Gone: known.
    Still wrong at the same place: it only resembles the bug, and fails the
    gate. No workaround (or none this path can apply): known by signature
    only, shown apart. What the worked-around run shows that the plain run did
    not (a second bug the first one hid, as ``split.twin`` exposes) is new.
    Up to ``workers`` paths in a child of their own are checked side by side."""
    by_name = {p.name: p for p in live}
    seen = {(r.path, r.signature) for r in rows}
    _start_children(rows, by_name, evidence.led)
    firsts: dict[tuple[str, str, str | None], Row] = {}
    for r in rows:
        if r.status == "known" and r.bug is not None:
            firsts.setdefault((r.bug, r.path, r.signature), r)
    verdicts = _all_verdicts(firsts, by_name, evidence, slack, workers)
    for r in list(rows):
        if r.status != "known" or r.bug is None:
            continue
        key = (r.bug, r.path, r.signature)
        v, bug = verdicts[key]
        if firsts.pop(key, None) is not None:
            for d in v.exposed:
                if (d.path, d.signature) not in seen:
                    seen.add((d.path, d.signature))
                    rows.append(row_of("new", d, None, f"{r.source}, with {v.workaround} in force"))
        r.status, r.detail, r.bug, r.upstream = v.status, f"{r.detail} [{v.note}]", bug.id, bug.upstream


Key = tuple[str, str, "str | None"]


def _all_verdicts(firsts: dict[Key, Row], by_name: dict[str, Path], evidence: Evidence, slack: float | None,
                  workers: int) -> dict[Key, tuple[Verdict, ledger_mod.Site]]:
    """Each key's verdict. Those of a path in a child of its own run in a
    thread per path (each child meets its cases in the one-thread order, and
    no probe patches this process for them, see ``WorkedAround.run``), after the
    others, one at a time here."""
    out: dict[Key, tuple[Verdict, ledger_mod.Site]] = {}
    apart: dict[str, list[Key]] = {}
    for key, r in firsts.items():
        path = by_name.get(r.path)
        if workers > 1 and path is not None and in_child(path):
            apart.setdefault(r.path, []).append(key)
        else:
            out[key] = _verdict(r, path, evidence, slack)
    if not apart:
        return out

    def check(keys: list[Key]) -> None:
        for key in keys:
            r = firsts[key]
            out[key] = _verdict(r, by_name.get(r.path), evidence, slack)

    with ThreadPoolExecutor(max_workers=min(workers, len(apart))) as pool:
        for done in [pool.submit(check, keys) for keys in apart.values()]:
            done.result()
    return out


def _verdict(r: Row, path: Path | None, evidence: Evidence, slack: float | None
             ) -> tuple[Verdict, ledger_mod.Site]:
    """The row's bug's check; where it leaves the case wrong, or is a fix
    probe that also removes another bug's divergence (so says nothing of
    its own bug), the first other bug the row fits whose check does, else
    two of them stacked."""
    led, version = evidence.led, evidence.version
    bug = led.by_id(r.bug, r.path)
    v = _workaround_verdict(led, bug, path, r, slack, version)
    others = evidence.others(r) if v.status == "resembles" or v.wider else []
    for other in others:
        w = _workaround_verdict(led, other, path, r, slack, version)
        if w.status != "resembles" and not (v.wider and w.status == "known_signature_only"):
            return replace(w, note=f"not {r.bug} ({v.note}); {w.note}"), other
    for other in others:  # each alone leaves it wrong: two of them stacked in one case?
        w = _stacked_verdict(bug, other, path, r, slack)
        if w is not None:
            return w, bug
    return v, bug


def _start_children(rows: list[Row], by_name: dict[str, Path], led: ledger_mod.Ledger) -> None:
    """Start the child process of every path in a child that a known row
    will run on (the compile flavours, a child each), all at once: each
    takes seconds to import torch and its compiler, and the checks below
    use them one at a time. Which runs where is unchanged, so is the verdict."""
    for r in rows:
        path = by_name.get(r.path)
        if r.status != "known" or r.bug is None or r.case is None or not hasattr(path, "start_soon"):
            continue
        wa = led.by_id(r.bug, r.path).check
        if wa != ledger_mod.NO_WORKAROUND and apply(path, wa) is not None:
            path.start_soon()  # a second row on the path finds its child started: nothing to do


def claim_new(rows: list[Row], live: list[Path], led: ledger_mod.Ledger, version: str, slack: float | None) -> None:
    """A new row on a path whose ledger bug ``claims`` by workaround (its
    signatures depend on the case's numbers, so a bigger run meets ones the
    ledger never saw): run again with that bug's workaround; gone, it is that
    bug, known, whatever its signature. Still wrong, or a workaround that
    cannot run: it stays new. The first such bug in ledger order that
    removes it takes it, so the verdict does not depend on the run."""
    by_name = {p.name: p for p in live}
    for r in rows:
        if r.status != "new" or r.case is None:
            continue
        for bug in claiming(led, r.path, version):
            v = _workaround_verdict(led, bug, by_name.get(r.path), r, slack, version)
            if v.status in ("known", "known_probe") and not v.exposed:
                r.status, r.bug, r.upstream, r.finding_class = v.status, bug.id, bug.upstream, bug.finding_class
                r.detail = f"{r.detail} [claimed by {bug.id}: {v.note}; signature {r.signature} not in its entry]"
                break


def claiming(led: ledger_mod.Ledger, path: str, version: str) -> list[ledger_mod.Site]:
    """The bugs of ``path`` affecting ``version`` that claim by workaround, in ledger order."""
    return [b for b in led.for_path(path) if b.claims == "workaround" and b.relation(version) == "in"]


@dataclass
class Verdict:
    status: str
    note: str
    workaround: str = ""
    exposed: list[Divergence] = field(default_factory=list)
    wider: bool = False  # a fix probe that also removed another bug's divergence: no evidence either way


def _workaround_verdict(led: ledger_mod.Ledger, bug: ledger_mod.Site, path: Path | None, row: Row,
                        slack: float | None, version: str) -> Verdict:
    """Run the row's case again with the bug's outside workaround in force,
    or, where it has none, its fix probe (an in-process patch of torch that
    removes exactly that bug: a check, never advice, so its rows are
    ``known_probe``, apart). Gone at its place: known. A fix probe must also
    leave everything else as it was: one that removes another ledger bug's
    divergence too is not a check of this bug alone."""
    worked = _worked_around(bug, path, row)
    if isinstance(worked, Verdict):
        return worked
    assert path is not None and row.case is not None  # else _worked_around said why not
    cc = CaseCheck(Case.from_json(row.case), slack=slack)
    return _compared(led, bug, path, row, cc.run(path), cc.run(worked), slack, version)


def _where(row: Row) -> tuple[str | None, tuple[Any, Any, Any]]:
    """The row's divergence as a check's run is held to it: its shape, and
    its place (kind, parameter, microbatch)."""
    d0 = row.divergence or {}
    return d0.get("shape"), (d0.get("kind"), d0.get("param"), d0.get("microbatch"))


def _what(check: str) -> str:
    return f"fix probe {check}" if check in probes.PROBES else f"workaround {check}"


def _worked_around(bug: ledger_mod.Site, path: Path | None, row: Row) -> Path | Verdict:
    """``path`` with the bug's check in force, or why the row can be known by
    signature only."""
    wa = bug.check
    if wa == ledger_mod.NO_WORKAROUND:
        why = f"no fix probe: {bug.no_probe}" if bug.no_probe else "the ledger knows no workaround or fix probe"
        return Verdict("known_signature_only", f"{why}: matched by signature only")
    what = _what(wa)
    if wa in probes.PROBES and (why := probes.available(wa)) is not None:
        return Verdict("known_signature_only", f"{what} does not apply to this torch ({why[:160]}): by signature only")
    worked = apply(path, wa) if path is not None and row.case is not None else None
    if worked is None:
        return Verdict("known_signature_only", f"{what} is not applied on {row.path} here: by signature only")
    if worked.supports(Case.from_json(row.case)) is not None:
        return Verdict("known_signature_only",
                       f"the case is outside {row.path}'s contract with {wa}: by signature only")
    return worked


def _compared(led: ledger_mod.Ledger, bug: ledger_mod.Site, path: Path, row: Row, plain: list[Divergence],
              left: list[Divergence], slack: float | None, version: str) -> Verdict:
    """The verdict of the case's ``plain`` run against its run with the bug's
    check in force (``left``): still wrong at the row's place, it resembles;
    a probe that also removed another bug's divergence is tried in isolation;
    what only the worked-around run shows is exposed, a second bug."""
    wa, what, is_probe = bug.check, _what(bug.check), bug.check in probes.PROBES
    shape, place = _where(row)
    here = [d for d in left if d.shape == shape
            or (d.kind, d.param, d.microbatch) == place and not _other_bug(led, bug, d, version)]
    if here:
        return Verdict("resembles", f"resembles {bug.id}, but its {what} leaves the case wrong there: "
                       f"{here[0].detail[:160]}")
    shown, kept = {d.shape for d in plain}, {d.shape for d in left}
    if is_probe:
        also = [d for d in plain if d.shape not in kept and _apart(led, bug, d, version)]
        if also:
            others = [b for d in also if (b := led.match(d.path, d.signature, version=version)) is not None]
            return _isolated_verdict(bug, others, path, row, slack) or Verdict(
                "known_signature_only", f"{what} removes it but also another bug's divergence "
                f"({also[0].detail[:120]}): not a check of {bug.id} alone, by signature only", wider=True)
    exposed = [d for d in left if d.shape not in shown and not _other_bug(led, bug, d, version)]
    for d in exposed:
        d.case = row.case
    if is_probe:
        return Verdict("known_probe", f"confirmed by {what}: it removes it, nothing else changes "
                       "(a check, not advice: no outside workaround)", wa, exposed)
    return Verdict("known", f"confirmed: {wa} removes it", wa, exposed)


def _apart(led: ledger_mod.Ledger, bug: ledger_mod.Site, d: Divergence, version: str) -> bool:
    """Whether a divergence a fix probe removed is another bug's, which the
    probe is not about: filed under another bug affecting this version whose
    check differs. One whose signature ``bug`` records itself, or a bug with
    the same fix records, is evidence for it (signatures are coarse; ledger
    order picks the first that fits, and one fix removing both is no sign
    of a probe wider than its bug)."""
    if d.signature in bug.signatures or any(d.signature in s.signatures and s.check == bug.check
                                            for s in led.for_path(d.path)):
        return False
    return _other_bug(led, bug, d, version, other_check=True)


def _other_bug(led: ledger_mod.Ledger, bug: ledger_mod.Site, d: Divergence, version: str,
               other_check: bool = False) -> bool:
    """Whether ``d`` is recorded under another ledger bug of its path that
    affects this version (with another check, where ``other_check``)."""
    b = led.match(d.path, d.signature, version=version)
    return (b is not None and b.id != bug.id and b.relation(version) == "in"
            and not (other_check and b.check == bug.check))


def _isolated_verdict(bug: ledger_mod.Site, others: list[ledger_mod.Site], path: Path | None, row: Row,
                      slack: float | None) -> Verdict | None:
    """A fix probe that removed another bug's divergence besides the row's
    (a transposed grad adopted by the split W pass that a fused optimizer
    then steps wrong: the layout probe removes both) is tried again with an
    outside workaround in force on both sides, one that takes the other
    divergence away and leaves the row's: the probe then removing the row's
    divergence, and nothing else, is the evidence a case of this bug alone
    gives. The other bugs' own workarounds are tried first, then the path's
    others (signatures are coarse: the bug a signature names first may not
    be the one that showed). None where no workaround isolates it."""
    if path is None or row.case is None:
        return None
    case = Case.from_json(row.case)
    shape, _ = _where(row)
    tried = [o.check for o in others] + list(getattr(path, "workarounds", ()))
    for wa in dict.fromkeys(c for c in tried if c in WORKAROUNDS):
        base = apply(path, wa)
        if base is None or base.supports(case) is not None:
            continue
        cc = CaseCheck(case, slack=slack)
        plain = cc.run(base)
        if {d.shape for d in plain} != {shape}:
            continue  # the workaround leaves another divergence, or takes the row's away too
        if cc.run(WorkedAround(base, bug.check)):
            return None  # the probe leaves something wrong: not this bug's check
        return Verdict("known_probe", f"confirmed by fix probe {bug.check} with the workaround {wa} in force (which "
                       "takes the other divergence away): it removes it, nothing else changes (a check, not advice: "
                       "no outside workaround)", bug.check)
    return None


def _stacked_verdict(bug: ledger_mod.Site, other: ledger_mod.Site, path: Path | None, row: Row,
                     slack: float | None) -> Verdict | None:
    """Two ledger bugs in one case (seen: DualPipeV on two ranks doubling two
    microbatches through the AccumulateGrad view steal and dropping the
    split one's weight grad): each bug's check alone leaves the case wrong at
    the same place, so each alone reads "resembles". Both in force at once,
    the case agrees there: known, as the row's bug stacked with the other;
    a fix probe among the two makes it ``known_probe``. None when either
    cannot apply here or the case stays wrong."""
    checks = [bug.check, other.check]
    if ledger_mod.NO_WORKAROUND in checks or path is None or row.case is None or checks[0] == checks[1]:
        return None
    if any(c in probes.PROBES and probes.available(c) is not None for c in checks):
        return None
    if all(c in probes.PROBES for c in checks) and not probes.stackable(*checks):
        return None
    # The path's own workaround first (it may be a path of its own), a probe around it.
    first, second = sorted(checks, key=lambda c: c in probes.PROBES)
    inner = apply(path, first)
    if inner is None or not (second in probes.PROBES or second in getattr(path, "workarounds", ())):
        return None
    worked, case = WorkedAround(inner, second), Case.from_json(row.case)
    if worked.supports(case) is not None:
        return None
    left = CaseCheck(case, slack=slack).run(worked)
    shape, place = _where(row)
    if any(d.shape == shape or (d.kind, d.param, d.microbatch) == place for d in left):
        return None
    status = "known_probe" if any(c in probes.PROBES for c in checks) else "known"
    return Verdict(status, f"stacked with {other.id}: {bug.id}'s {bug.check} or {other.id}'s {other.check} alone "
                   f"leaves it wrong, both together remove it", f"{first}+{second}")
