"""The gate's phases: self-check, replay, fuzz, confirm known, claim new.

Each reads and adds to one ``Context``: the report's rows, and the
``Evidence`` the replay leaves for the phases after it. ``run.run_gate``
runs them in order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable

from harness.artifacts import corpus
from harness.canaries import all_canaries, for_paths
from harness.engine.check import Replayed, replay_entries
from harness.engine.replay_pool import ReplayError, replay_on_workers
from harness.engine.runner import Result, fuzz
from harness.gate import known
from harness.gate import ledger as ledger_mod
from harness.gate.evidence import Evidence
from harness.gate.rows import GateReport, Row, classify, row_of
from harness.gate.selfcheck import CanaryResult, selfcheck
from harness.observation import Divergence
from harness.paths import Options, Path, close_paths, split_available


def _quiet(line: str) -> None:
    pass


@dataclass
class GateSettings:
    """What ``gradfuzz gate``'s options ask of a run."""

    corpus_dirs: list[str]
    ledger_file: str
    minutes: float | None = None
    examples: int | None = None
    seed: int = 0
    save_dir: str | None = None
    run_selfcheck: bool = True
    progress: Callable[[str], None] = _quiet
    slack: float | None = None
    # Runs the fuzzing phase elsewhere (``gate -n N``: on N processes); it
    # takes the live paths and ``fuzz``'s budget keywords.
    fuzzer: Callable[..., Result] | None = None
    workers: int = 1
    options: Options | None = None


@dataclass
class Context:
    """What every phase reads and adds to: one run's ledger, report and
    evidence, so a phase's inputs are not threaded through the others."""

    settings: GateSettings
    led: ledger_mod.Ledger
    version: str
    report: GateReport
    entries: list[corpus.Entry]
    evidence: Evidence
    live: list[Path] = field(default_factory=list)  # the paths that can run here, once the replay split them

    @classmethod
    def start(cls, settings: GateSettings, report: GateReport) -> Context:
        led = ledger_mod.load(settings.ledger_file)
        entries = [corpus.load(f) for f in corpus.discover(settings.corpus_dirs)]
        return cls(settings, led, report.torch, report, entries, Evidence(led, report.torch))


def selfcheck_phase(ctx: Context, paths: list[Path]) -> None:
    """A canary not caught, or broken, fails the gate: it has lost its
    teeth. Only the canaries of the families ``paths`` come from run."""
    s = ctx.settings
    todo = for_paths([p.name for p in paths])
    left = len(all_canaries()) - len(todo)
    if left:
        s.progress(f"[selfcheck] {len(todo)} canaries of the families --paths selects; {left} of the others not run")
    ctx.report.selfcheck = selfcheck(s.seed, s.progress, s.slack, canaries=todo, workers=s.workers)
    for c in ctx.report.selfcheck:
        why = {"broken": f"is broken: {c.broken}", "missed": f"was not caught: {c.detail}"}.get(c.state)
        if why is not None:
            ctx.report.rows.append(Row("selfcheck", c.name, f"canary {c.name} {why}", source="selfcheck"))


def replay_phase(ctx: Context, paths: list[Path]) -> None:
    """The corpus replay on every path that can run here (on ``workers``
    processes where it can: the same (case, path) results in the one-process
    order, so the verdict does not depend on N); its rows, and the evidence
    the later phases read, empty where the replay failed."""
    s = ctx.settings
    ctx.live, unavailable = split_available(paths)
    ctx.report.rows.extend(Row("unavailable", name, why) for name, why in unavailable.items())
    try:
        gathered = bool(s.workers > 1 and s.options is not None and s.slack is None and ctx.live and ctx.entries)
        if gathered:
            results: Iterable[Replayed] = replay_on_workers(ctx.entries, ctx.live, s.workers, s.options, s.progress)
        else:
            results = replay_entries(ctx.entries, ctx.live, s.slack)
        _Replay(ctx, count=not gathered).walk(results)
    except ReplayError as e:  # what did not replay cannot be classified: fixed or not_reproduced would be guesses
        ctx.report.rows.append(Row("error", "replay", str(e)[:4000], source="replay"))
    finally:
        close_paths(ctx.live)


def fuzzing(ctx: Context) -> bool:
    """Whether the fuzzing phase has a budget and a path to spend it on."""
    return bool(ctx.live and (ctx.settings.examples or ctx.settings.minutes))


def fuzz_phase(ctx: Context) -> None:
    """One row per fuzzed (path, signature) the replay did not already report."""
    s, report = ctx.settings, ctx.report
    # --examples: the same cases on every machine whatever its load (the CI form); --minutes: local use.
    # A first hit the ledger already places is kept as drawn (``ledger.settled_by``), on workers too.
    fuzzer = s.fuzzer or partial(fuzz, settled=ledger_mod.settled_by(ctx.led, ctx.version))
    result = fuzzer(ctx.live, examples=s.examples, minutes=None if s.examples else s.minutes, seed=s.seed,
                    save_dir=s.save_dir, progress=s.progress, slack=s.slack)
    # Part of the budget that did not run cannot have passed: a harness error fails the gate.
    report.rows.extend(Row("error", "fuzz", e[:2000], source="fuzz") for e in result.errors)
    for name, t in result.paths.items():
        report.examples[name] = report.examples.get(name, 0) + t.examples
        if t.unjudged:
            report.unjudged[name] = report.unjudged.get(name, 0) + t.unjudged
    report.rows.extend(_fuzz_rows(result.divergences, report.rows, ctx.evidence))


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


def confirm_phase(ctx: Context) -> None:
    known.confirm_known(ctx.report.rows, ctx.live, ctx.evidence, ctx.settings.slack, ctx.settings.workers)


def claim_phase(ctx: Context) -> None:
    known.claim_new(ctx.report.rows, ctx.live, ctx.led, ctx.version, ctx.settings.slack)


class _Replay:
    """The replay's divergences sorted by ledger bug as its results come, then
    its rows. A case filed under a bug is evidence about that bug; any other
    case's divergence goes to the bug whose signature it shows, decided once
    every ledger case has shown its signatures."""

    def __init__(self, ctx: Context, count: bool) -> None:
        self.ctx, self.led, self.version = ctx, ctx.led, ctx.version
        self.reproduced: dict[str, list[Divergence]] = {}
        self.ran: set[tuple[str, str]] = set()  # (bug id, place) whose cases ran here
        self.unmatched: list[tuple[Divergence, str]] = []
        # ``count`` False: the results were gathered already (the workers
        # counted the replay as it ran): walking them is no second count.
        self.progress = _ReplayProgress(ctx, len(ctx.entries)) if count else None

    def walk(self, results: Iterable[Replayed]) -> None:
        report = self.ctx.report
        for r in results:
            if self.progress is not None:
                self.progress.at(r.entry.file)
            if r.skipped is not None:
                continue
            report.examples[r.path.name] = report.examples.get(r.path.name, 0) + 1
            self.file(r.path.name, r.entry.file, r.divergences)
        self.ctx.evidence = Evidence.of(self.led, self.version, self.reproduced)
        for d, file in self.unmatched:
            b = self.ctx.evidence.owner(d)
            if b is not None:
                self.add(b, d)
            else:  # the ledger is the gate's authority; a case's own meta.expect is not
                report.rows.append(row_of("new", d, None, f"corpus {file}"))
        report.rows.extend(_bug_rows(self.led, {p.name for p in self.ctx.live}, self.reproduced, self.ran,
                                     self.version))

    def file(self, path: str, file: str, divs: list[Divergence]) -> None:
        """One (case, path) result under the bug it is evidence about."""
        owners = [b for b in self.led.for_path(path) if self.led.is_case_of(b, file)]
        if owners:
            # A case filed under several bugs: each divergence goes to the one
            # whose recorded signatures name it, else to the first.
            if not divs:  # the case agrees: evidence about the bug it is first filed under
                self.add(owners[0], None)
            for d in divs:
                self.add(_owner_of(self.led, owners, d, self.version), d)
            return
        for d in divs:
            b = self.led.match(path, d.signature, version=self.version)
            if b is not None:
                self.add(b, d)
            else:
                self.unmatched.append((d, file))
        self.ctx.settings.progress(f"[case] {path} {file}: {len(divs)} divergence(s)")

    def add(self, site: ledger_mod.Site, d: Divergence | None) -> None:
        self.ran.add((site.id, site.path))
        divs = self.reproduced.setdefault(site.id, [])
        if d is not None:
            divs.append(d)


class _ReplayProgress:
    """A progress line at most every 5 seconds, and at the last case."""

    def __init__(self, ctx: Context, n_entries: int) -> None:
        self.say, self.n, self.paths = ctx.settings.progress, n_entries, len(ctx.live)
        self.started, self.shown, self.done = time.monotonic(), 0.0, 0
        self.last_file: str | None = None

    def at(self, file: str) -> None:
        if file == self.last_file:
            return
        self.last_file, self.done = file, self.done + 1
        now = time.monotonic()
        if now - self.shown >= 5 or self.done == self.n:
            self.shown = now
            left = (now - self.started) / self.done * (self.n - self.done)
            self.say(f"[phase] replay {self.done}/{self.n} corpus cases on {self.paths} paths, ~{left:.0f}s left")


def _bug_rows(led: ledger_mod.Ledger, live_names: set[str], reproduced: dict[str, list[Divergence]],
              ran: set[tuple[str, str]], version: str) -> list[Row]:
    """What the replay says of each ledger bug at each place whose cases ran
    here: its divergences, one row each, or a row saying it is fixed or not
    reproduced there."""
    rows = []
    for b in led.sites:
        if not any(b.covers(n) for n in live_names):
            continue
        # This place's paths only: another place of the bug may reproduce where this one does not.
        divs = [d for d in reproduced.get(b.id, []) if b.covers(d.path)]
        if (b.id, b.path) not in ran or not divs and b.relation(version) == "before":
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
