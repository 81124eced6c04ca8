"""``gradfuzz gate``: the check a team runs when it upgrades torch.

Self-check, corpus replay, a fuzzing budget, then every result classified
against the ledger and the installed torch version:

- ``new``: a divergence no ledger entry explains (fails the gate)
- ``known``: a ledger bug, expected on this version (listed)
- ``fixed``: a ledger bug this version no longer shows, past its range (good news)
- ``regression``: a ledger bug back on a version past its range (fails)
- ``not_reproduced``: in range, but its cases agree here (the ledger may be too wide)
- ``unavailable``: a path that cannot run here, with why
- ``selfcheck``: a canary that was not caught (fails: the gate has lost its teeth)
- ``error``: part of the gate did not run (a harness error: the oracle or a
  worker session failed); fails, since what did not run cannot have passed
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import torch

from harness.artifacts import corpus
from harness.gate import ledger as ledger_mod
from harness.observation import Divergence
from harness.case.spec import Case
from harness.engine.check import CaseCheck, Replayed, replay_entries
from harness.engine.replay_pool import ReplayError, replay_on_workers
from harness.engine.runner import Result, fuzz
from harness.paths import Options, Path, close_paths, split_available
from harness.paths.workarounds import WorkedAround, apply
from harness.materialize import probes
from harness.materialize.workarounds import WORKAROUNDS
from harness.gate.rows import GateReport, Row, classify, row_of
from harness.gate.selfcheck import CanaryResult, selfcheck
def stacks_installed() -> dict[str, str]:
    """The release of every family's training stack installed here (``Family.package``)."""
    from harness.artifacts.corpus import installed
    from harness.paths import families

    found = {f.package: installed(f.package) for f in families() if f.package}
    return {k: v for k, v in sorted(found.items()) if v}


def run_gate(
    paths: list[Path],
    *,
    corpus_dirs: list[str],
    ledger_file: str,
    minutes: float | None = None,
    examples: int | None = None,
    seed: int = 0,
    save_dir: str | None = None,
    run_selfcheck: bool = True,
    progress: Callable[[str], None] = lambda s: None,
    slack: float | None = None,
    fuzzer: Callable[..., Result] | None = None,
    workers: int = 1,
    options: Options | None = None,
) -> GateReport:
    """``fuzzer`` runs the fuzzing phase elsewhere (``gate -n N``: on N
    processes); it takes the live paths and ``fuzz``'s budget keywords."""
    start = time.monotonic()
    version = torch.__version__
    report = GateReport(torch=version, packages=stacks_installed())
    lap = _Lap(report.phases)
    led = ledger_mod.load(ledger_file)
    entries = [corpus.load(f) for f in corpus.discover(corpus_dirs)]
    if run_selfcheck:
        report.selfcheck = selfcheck(seed, progress, slack, workers=workers)
        report.rows.extend(_selfcheck_rows(report.selfcheck))
        lap("self-check")
    live, unavailable = split_available(paths)
    report.rows.extend(Row("unavailable", name, why) for name, why in unavailable.items())
    seen_as, seen_by, shapes = _replay_phase(entries, live, led, version, report, progress, slack, workers, options)
    lap("replay")
    if live and (examples or minutes):
        # --examples: the same cases on every machine whatever its load (the CI form); --minutes: local use.
        result = (fuzzer or fuzz)(live, examples=examples, minutes=None if examples else minutes, seed=seed,
                                  save_dir=save_dir, progress=progress, slack=slack)
        # Part of the budget that did not run cannot have passed: a harness error fails the gate.
        report.rows.extend(Row("error", "fuzz", e[:2000], source="fuzz") for e in result.errors)
        for name, t in result.paths.items():
            report.examples[name] = report.examples.get(name, 0) + t.examples
        report.rows.extend(_fuzz_rows(result.divergences, report.rows, led, version, seen_as, shapes))
        lap("fuzz")
    confirm_known(report.rows, live, led, slack, version, Fits(led, seen_by, shapes, version))
    lap("workarounds")
    report.rows = one_row_per_bug(report.rows)
    report.seconds = time.monotonic() - start
    return report


def _replay_phase(entries: list[corpus.Entry], live: list[Path], led: ledger_mod.Ledger, version: str,
                  report: GateReport, progress: Callable[[str], None], slack: float | None, workers: int,
                  options: Options | None
                  ) -> tuple[dict[tuple[str, str], ledger_mod.Site], dict[tuple[str, str], set[str]], set[tuple[str, str]]]:
    """The corpus replay on every live path (on ``workers`` processes where
    it can: the same (case, path) results in the one-process order, so the
    verdict does not depend on N), its rows added to ``report``; what
    ``_replay`` returns, empty where the replay failed."""
    try:
        gathered = bool(workers > 1 and options is not None and slack is None and live and entries)
        if gathered:
            results: Iterable[Replayed] = replay_on_workers(entries, live, workers, options, progress)
        else:
            results = replay_entries(entries, live, slack)
        return _replay(live, results, led, version, report, progress, len(entries), count=not gathered)
    except ReplayError as e:  # what did not replay cannot be classified: fixed or not_reproduced would be guesses
        report.rows.append(Row("error", "replay", str(e)[:4000], source="replay"))
        return {}, {}, set()
    finally:
        close_paths(live)


class _Lap:
    """Records the seconds since the last lap under a phase's name."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into, self.t = into, time.monotonic()

    def __call__(self, phase: str) -> None:
        now = time.monotonic()
        self.into[phase] = self.into.get(phase, 0.0) + now - self.t
        self.t = now


def _selfcheck_rows(results: list[CanaryResult]) -> list[Row]:
    rows = []
    for c in results:
        if c.state == "broken":
            rows.append(Row("selfcheck", c.name, f"canary {c.name} is broken: {c.broken}", source="selfcheck"))
        elif c.state == "missed":
            rows.append(Row("selfcheck", c.name, f"canary {c.name} was not caught: {c.detail}", source="selfcheck"))
    return rows


def _fuzz_rows(divergences: list[Divergence], rows: list[Row], led: ledger_mod.Ledger, version: str,
               seen_as: dict[tuple[str, str], ledger_mod.Site], shapes: set[tuple[str, str]]) -> list[Row]:
    """One row per fuzzed (path, signature) the replay did not already report.
    A ledger bug matches by its recorded signatures, or by any signature its
    own cases showed in the replay just now, on this path or (by shape) on
    another path the bug's entry covers."""
    seen = {(r.path, r.signature) for r in rows}
    # Bugs whose own cases agreed in the replay just now: a coarse signature
    # is no evidence that one of them came back (a regression needs more).
    fixed_here = {r.bug for r in rows if r.status == "fixed"}
    out = []
    for d in divergences:
        if (d.path, d.signature) in seen:
            continue
        seen.add((d.path, d.signature))
        bug = led.match(d.path, d.signature, version=version)
        if bug is not None and bug.id in fixed_here:
            bug = None
        bug = bug or seen_as.get((d.path, d.signature)) or _by_shape(led, shapes, d, version)
        out.append(row_of(classify(bug, version, True) if bug else "new", d, bug, "fuzz"))
    return out


@dataclass
class Fits:
    """Every ledger bug a row's signature fits on its path, not only the one
    the match picked: coarse signatures (a value ratio class, "no grad") are
    shared by bugs of one path, and a workaround that leaves the case wrong
    says only that it is not that one."""

    led: ledger_mod.Ledger
    seen_by: dict[tuple[str, str], set[str]]
    shapes: set[tuple[str, str]]
    version: str

    def others(self, r: Row) -> list[ledger_mod.Site]:
        shape = (r.divergence or {}).get("shape")
        ids = self.seen_by.get((r.path, r.signature or ""), set())
        fits = [b for b in self.led.for_path(r.path) if r.signature in b.signatures or b.id in ids
                or shape and (b.id, shape) in self.shapes]
        out: list[ledger_mod.Site] = []
        for b in fits:
            if b.id != r.bug and b.relation(self.version) == "in" and all(b.id != o.id for o in out):
                out.append(b)
        return out


def confirm_known(rows: list[Row], live: list[Path], led: ledger_mod.Ledger, slack: float | None,
                  version: str, fits: Fits | None = None) -> None:
    """"Known" is causal: each (bug, path, signature) row the ledger would call
    known is run again with the bug's outside workaround in force. Gone: known.
    Still wrong at the same place: it only resembles the bug, and fails the
    gate. No workaround (or none this path can apply): known by signature
    only, shown apart. What the worked-around run shows that the plain run did
    not (a second bug the first one hid, as ``split.twin`` exposes) is new."""
    by_name = {p.name: p for p in live}
    verdicts: dict[tuple[str, str, str | None], tuple[Verdict, ledger_mod.Site]] = {}
    seen = {(r.path, r.signature) for r in rows}
    _start_children(rows, by_name, led)
    for r in list(rows):
        if r.status != "known" or r.bug is None:
            continue
        key = (r.bug, r.path, r.signature)
        if key not in verdicts:
            bug = led.by_id(r.bug, r.path)
            v = _workaround_verdict(led, bug, by_name.get(r.path), r, slack, version)
            others = fits.others(r) if fits is not None and v.status == "resembles" else []
            for other in others:
                w = _workaround_verdict(led, other, by_name.get(r.path), r, slack, version)
                if w.status != "resembles":
                    v, bug = replace(w, note=f"not {r.bug} ({v.note}); {w.note}"), other
                    break
            else:
                for other in others:  # each alone leaves it wrong: two of them stacked in one case?
                    w = _stacked_verdict(bug, other, by_name.get(r.path), r, slack)
                    if w is not None:
                        v = w
                        break
            verdicts[key] = (v, bug)
            for d in v.exposed:
                if (d.path, d.signature) not in seen:
                    seen.add((d.path, d.signature))
                    rows.append(row_of("new", d, None, f"{r.source}, with {v.workaround} in force"))
        v, bug = verdicts[key]
        r.status, r.detail, r.bug, r.upstream = v.status, f"{r.detail} [{v.note}]", bug.id, bug.upstream
    claim_new(rows, by_name, led, slack, version)


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


def claim_new(rows: list[Row], by_name: dict[str, Path], led: ledger_mod.Ledger, slack: float | None,
              version: str) -> None:
    """A new row on a path whose ledger bug ``claims`` by workaround (its
    signatures depend on the case's numbers, so a bigger run meets ones the
    ledger never saw): run again with that bug's workaround; gone, it is that
    bug, known, whatever its signature. Still wrong, or a workaround that
    cannot run: it stays new. The first such bug in ledger order that
    removes it takes it, so the verdict does not depend on the run."""
    for r in rows:
        if r.status != "new" or r.case is None:
            continue
        for bug in led.for_path(r.path):
            if bug.claims != "workaround" or bug.relation(version) != "in":
                continue
            v = _workaround_verdict(led, bug, by_name.get(r.path), r, slack, version)
            if v.status in ("known", "known_probe") and not v.exposed:
                r.status, r.bug, r.upstream, r.finding_class = v.status, bug.id, bug.upstream, bug.finding_class
                r.detail = f"{r.detail} [claimed by {bug.id}: {v.note}; signature {r.signature} not in its entry]"
                break


@dataclass
class Verdict:
    status: str
    note: str
    workaround: str = ""
    exposed: list[Divergence] = field(default_factory=list)


def _workaround_verdict(led: ledger_mod.Ledger, bug: ledger_mod.Site, path: Path | None, row: Row,
                        slack: float | None, version: str) -> Verdict:
    """Run the row's case again with the bug's outside workaround in force,
    or, where it has none, its fix probe (an in-process patch of torch that
    removes exactly that bug: a check, never advice, so its rows are
    ``known_probe``, apart). Gone at its place: known. A fix probe must also
    leave everything else as it was: one that removes another ledger bug's
    divergence too is not a check of this bug alone."""
    wa = bug.check
    if wa == ledger_mod.NO_WORKAROUND:
        why = f"no fix probe: {bug.no_probe}" if bug.no_probe else "the ledger knows no workaround or fix probe"
        return Verdict("known_signature_only", f"{why}: matched by signature only")
    is_probe = wa in probes.PROBES
    what = f"fix probe {wa}" if is_probe else f"workaround {wa}"
    if is_probe and (why := probes.available(wa)) is not None:
        return Verdict("known_signature_only", f"{what} does not apply to this torch ({why[:160]}): by signature only")
    worked = apply(path, wa) if path is not None and row.case is not None else None
    if worked is None:
        return Verdict("known_signature_only", f"{what} is not applied on {row.path} here: by signature only")
    case = Case.from_json(row.case)
    if worked.supports(case) is not None:
        return Verdict("known_signature_only", f"the case is outside {row.path}'s contract with {wa}: by signature only")
    cc = CaseCheck(case, slack=slack)
    plain, left = cc.run(path), cc.run(worked)
    d0 = row.divergence or {}
    place = (d0.get("kind"), d0.get("param"), d0.get("microbatch"))

    def other_bug(d: Divergence) -> bool:
        return _other_bug(led, bug, d, version)

    here = [d for d in left if d.shape == d0.get("shape") or (d.kind, d.param, d.microbatch) == place and not other_bug(d)]
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
                f"({also[0].detail[:120]}): not a check of {bug.id} alone, by signature only")
    exposed = [d for d in left if d.shape not in shown and not other_bug(d)]
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
    shape = (row.divergence or {}).get("shape")
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
    # The path's own workaround first (it may be a path of its own), a probe around it.
    first, second = sorted(checks, key=lambda c: c in probes.PROBES)
    inner = apply(path, first)
    if inner is None or not (second in probes.PROBES or second in getattr(path, "workarounds", ())):
        return None
    worked, case = WorkedAround(inner, second), Case.from_json(row.case)
    if worked.supports(case) is not None:
        return None
    left = CaseCheck(case, slack=slack).run(worked)
    d0 = row.divergence or {}
    place = (d0.get("kind"), d0.get("param"), d0.get("microbatch"))
    if any(d.shape == d0.get("shape") or (d.kind, d.param, d.microbatch) == place for d in left):
        return None
    status = "known_probe" if any(c in probes.PROBES for c in checks) else "known"
    return Verdict(status, f"stacked with {other.id}: {bug.id}'s {bug.check} or {other.id}'s {other.check} alone "
                   f"leaves it wrong, both together remove it", f"{first}+{second}")


def one_row_per_bug(rows: list[Row]) -> list[Row]:
    """One row per (status, ledger bug, path): the first signature seen stands
    for the others. A racy bug (a send racing an in-place add on two ranks)
    shows one signature in one run and two in the next; counted per bug, the
    same seed and budget give the same counts. New findings stay one row per
    signature: each is news of its own."""
    seen: set[tuple[str, str, str]] = set()
    out = []
    for r in rows:
        if r.bug is not None:
            key = (r.status, r.bug, r.path)
            if key in seen:
                continue
            seen.add(key)
        out.append(r)
    return out


def _replay(live: list[Path], results: Iterable[Replayed], led: ledger_mod.Ledger, version: str, report: GateReport,
            progress, n_entries: int, count: bool = True
            ) -> tuple[dict[tuple[str, str], ledger_mod.Site], dict[tuple[str, str], set[str]], set[tuple[str, str]]]:
    """Returns, per (path, signature), the bug the replay filed it under
    and every bug whose own cases showed it; and (bug, shape) pairs seen.
    ``count`` False: the results were gathered already (the workers counted
    the replay as it ran), so walking them is not shown as a second count."""
    reproduced: dict[str, list[Divergence]] = {}
    ran: set[str] = set()
    unmatched: list[tuple[Divergence, str]] = []
    started, shown, done = time.monotonic(), 0.0, 0
    last_file = None
    for r in results:
        entry, p, divs = r.entry, r.path, r.divergences
        if entry.file != last_file:
            last_file, done = entry.file, done + 1
            now = time.monotonic()
            if count and (now - shown >= 5 or done == n_entries):
                shown = now
                left = (now - started) / done * (n_entries - done)
                progress(f"[phase] replay {done}/{n_entries} corpus cases on {len(live)} paths, ~{left:.0f}s left")
        if r.skipped is not None:
            continue
        report.examples[p.name] = report.examples.get(p.name, 0) + 1
        owners = [b for b in led.for_path(p.name) if led.is_case_of(b, entry.file)]
        if owners:
            # A case filed under several bugs: each divergence goes to the one
            # whose recorded signatures name it, else to the first.
            if not divs:  # the case agrees: evidence about the bug it is first filed under
                ran.add(owners[0].id)
                reproduced.setdefault(owners[0].id, [])
            for d in divs:
                b = _owner_of(led, owners, d, version)
                ran.add(b.id)
                reproduced.setdefault(b.id, []).append(d)
            continue
        for d in divs:
            b = led.match(p.name, d.signature, version=version)
            if b is not None:
                reproduced.setdefault(b.id, []).append(d)
                ran.add(b.id)
            else:  # decided once every ledger case has shown its signatures
                unmatched.append((d, entry.file))
        progress(f"[case] {p.name} {entry.file}: {len(divs)} divergence(s)")
    seen_as = {(d.path, d.signature): _site(led, i, d.path) for i, divs in reproduced.items() for d in divs}
    seen_by: dict[tuple[str, str], set[str]] = {}
    for i, divs in reproduced.items():
        for d in divs:
            seen_by.setdefault((d.path, d.signature), set()).add(i)
    shapes = {(i, d.shape) for i, divs in reproduced.items() for d in divs if d.shape}
    for d, file in unmatched:
        b = seen_as.get((d.path, d.signature)) or _by_shape(led, shapes, d, version)
        if b is not None:
            reproduced[b.id].append(d)
        else:  # the ledger is the gate's authority; a case's own meta.expect is not
            report.rows.append(row_of("new", d, None, f"corpus {file}"))
    report.rows.extend(_bug_rows(led, {p.name for p in live}, reproduced, ran, version))
    return seen_as, seen_by, shapes


def _bug_rows(led: ledger_mod.Ledger, live_names: set[str], reproduced: dict[str, list[Divergence]], ran: set[str],
              version: str) -> list[Row]:
    """What the replay says of each ledger bug whose cases ran here: its
    divergences, one row each, or a row saying it is fixed or not reproduced."""
    rows = []
    for b in led.sites:
        if not any(b.covers(n) for n in live_names):
            continue
        divs = reproduced.get(b.id, [])
        if b.id not in ran or not divs and b.relation(version) == "before":
            continue  # a bug that starts after this version and is absent here is no news
        status = classify(b, version, bool(divs))
        if divs:
            for d in divs:  # one row per path stays (one_row_per_bug)
                rows.append(row_of(status, d, b, f"corpus {', '.join(b.cases)}"))
        else:
            word = {"fixed": f"fixed on torch {version}: drop your workaround", "not_reproduced":
                    f"ledger says {b.range} is affected, but its cases agree here"}[status]
            rows.append(Row(status, b.path, f"{b.summary} ({word})", b.id, None,
                            f"corpus {', '.join(b.cases)}", upstream=b.upstream, finding_class=b.finding_class))
    return rows


def _site(led: ledger_mod.Ledger, bug_id: str, path: str) -> ledger_mod.Site:
    """Bug ``bug_id`` where ``path`` is: its place covering the path, else its
    first place (a divergence its own case showed on a path it does not list)."""
    bug = led.bug(bug_id)
    return bug.at(path) or bug.sites[0]


def _owner_of(led: ledger_mod.Ledger, owners: list[ledger_mod.Site], d: Divergence, version: str) -> ledger_mod.Site:
    """The bug a divergence on a case filed under ``owners`` belongs to: an
    owner affecting this version whose signatures name it; else any bug
    affecting this version that records it (a case filed under a bug that
    starts later can show an older bug here: on 2.11 a case of a 2.13
    zero-bubble bug shows the stale-buffer bug every schedule has); else an
    owner naming it; else the first owner."""
    named = ledger_mod.first([b for b in owners if d.signature in b.signatures], version)
    if named is not None and named.relation(version) == "in":
        return named
    other = led.match(d.path, d.signature, version=version)
    if other is not None and other.relation(version) == "in":
        return other
    return named or owners[0]


def _by_shape(led: ledger_mod.Ledger, shapes: set[tuple[str, str]], d: Divergence, version: str) -> ledger_mod.Site | None:
    """A bug whose entry covers ``d``'s path and whose own cases showed ``d``'s
    shape on some path in this run; one affecting ``version`` wins."""
    return ledger_mod.first([b for b in led.for_path(d.path) if (b.id, d.shape) in shapes], version)


def compare_baseline(report: dict[str, Any], baseline: dict[str, Any], selected: list[str] | None = None) -> list[str]:
    """What changed since the baseline report, path by path: what a person
    upgrading asks. ``selected``: the paths this gate ran (``--paths``); a
    baseline row of another path is not compared, since absent here means
    not run, not gone."""
    import fnmatch

    def index(r):
        out = {}
        for row in r.get("rows", []):
            key = (row["path"], row.get("bug") or row.get("signature") or row["detail"][:60])
            out[key] = row["status"]
        return out

    def ran(path: str) -> bool:  # a ledger row's path can be patterns (``split.twin, pipeline.*ZeroBubble*.stock``)
        return selected is None or any(fnmatch.fnmatchcase(n, p.strip()) for p in path.split(",") for n in selected)

    now, before = index(report), index(baseline)
    left_out = {k for k in before if k not in now and not ran(k[0])}
    before = {k: v for k, v in before.items() if k not in left_out}
    lines = [f"compared with {baseline.get('torch')} -> {report.get('torch')}:"
             + (f" ({len(left_out)} baseline row(s) of paths outside --paths not compared)" if left_out else "")]
    for path in sorted({k[0] for k in now} | {k[0] for k in before}):
        changes = []
        for key in sorted(set(now) | set(before)):
            if key[0] != path:
                continue
            a, b = before.get(key, "absent"), now.get(key, "absent")
            if a != b:
                changes.append(f"    {key[1]}: {a} -> {b}")
        lines.append(f"  {path}: " + ("no change" if not changes else f"{len(changes)} change(s)"))
        lines.extend(changes)
    return lines
