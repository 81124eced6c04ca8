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
from typing import Any, Callable, Iterable

import torch

from harness.artifacts import corpus
from harness.gate import ledger as ledger_mod
from harness.observation import Divergence
from harness.engine.check import Replayed, replay_entries
from harness.engine.replay_pool import ReplayError, replay_on_workers
from harness.engine.runner import Result, fuzz
from harness.paths import Options, Path, close_paths, split_available
from harness.gate.evidence import Evidence
from harness.gate.evidence import by_shape as _by_shape  # noqa: F401  (the tests' name)
from harness.gate.known import claim_new, confirm_known
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
    evidence = _replay_phase(entries, live, led, version, report, progress, slack, workers, options)
    lap("replay")
    if live and (examples or minutes):
        # --examples: the same cases on every machine whatever its load (the CI form); --minutes: local use.
        result = (fuzzer or fuzz)(live, examples=examples, minutes=None if examples else minutes, seed=seed,
                                  save_dir=save_dir, progress=progress, slack=slack)
        # Part of the budget that did not run cannot have passed: a harness error fails the gate.
        report.rows.extend(Row("error", "fuzz", e[:2000], source="fuzz") for e in result.errors)
        for name, t in result.paths.items():
            report.examples[name] = report.examples.get(name, 0) + t.examples
        report.rows.extend(_fuzz_rows(result.divergences, report.rows, evidence))
        lap("fuzz")
    confirm_known(report.rows, live, evidence, slack)
    claim_new(report.rows, live, led, version, slack)
    lap("workarounds")
    report.rows = one_row_per_bug(report.rows)
    report.seconds = time.monotonic() - start
    return report


def _replay_phase(entries: list[corpus.Entry], live: list[Path], led: ledger_mod.Ledger, version: str,
                  report: GateReport, progress: Callable[[str], None], slack: float | None, workers: int,
                  options: Options | None) -> Evidence:
    """The corpus replay on every live path (on ``workers`` processes where
    it can: the same (case, path) results in the one-process order, so the
    verdict does not depend on N), its rows added to ``report``; what it
    showed of the ledger, empty where the replay failed."""
    try:
        gathered = bool(workers > 1 and options is not None and slack is None and live and entries)
        if gathered:
            results: Iterable[Replayed] = replay_on_workers(entries, live, workers, options, progress)
        else:
            results = replay_entries(entries, live, slack)
        return _replay(live, results, led, version, report, progress, len(entries), count=not gathered)
    except ReplayError as e:  # what did not replay cannot be classified: fixed or not_reproduced would be guesses
        report.rows.append(Row("error", "replay", str(e)[:4000], source="replay"))
        return Evidence(led, version)
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


def _fuzz_rows(divergences: list[Divergence], rows: list[Row], evidence: Evidence) -> list[Row]:
    """A ledger bug matches by its recorded signatures, or by what the
    evidence says its own cases showed in the replay just now."""
    led, version = evidence.led, evidence.version
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
        bug = bug or evidence.owner(d)
        out.append(row_of(classify(bug, version, True) if bug else "new", d, bug, "fuzz"))
    return out


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
            progress, n_entries: int, count: bool = True) -> Evidence:
    """What the replay's own cases showed of each bug, its rows added to ``report``.
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
    evidence = Evidence.of(led, version, reproduced)
    for d, file in unmatched:
        b = evidence.owner(d)
        if b is not None:
            reproduced[b.id].append(d)
        else:  # the ledger is the gate's authority; a case's own meta.expect is not
            report.rows.append(row_of("new", d, None, f"corpus {file}"))
    report.rows.extend(_bug_rows(led, {p.name for p in live}, reproduced, ran, version))
    return evidence


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
