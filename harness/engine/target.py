"""Fuzz targets: paths that share a case distribution, fuzzed on one stream.

A target is a group of paths drawn from the same strategy (same contract
flags) plus a shard number, which picks its own seed stream. Each case is
drawn once, the eager oracle runs once, and every path of the group is
compared with it: for ``split`` that is one oracle for ``split.stock`` and
``split.fixed``, not one per path.

The run is a series of Hypothesis rounds, as in ``harness.engine.runner``: a round
stops at the first new signature on some path; from then on the round
*focuses* on that path (the others are not run), so Hypothesis shrinks
against the path that showed the failure and cannot slip to another. The
shrunk case is re-run to confirm it (or flag it flaky), saved at once
through ``harness.artifacts.findings`` (de-duplicated by signature), its signatures
become known, and the next round looks for something else.

Saved examples in the database (earlier runs' failures) are replayed first,
in a pass of their own before the seeded rounds: what they show is
reported at once, but they are not examples of the budget, and the rounds
then draw exactly as from a cold start. So the same seed and budget give
the same examples and counts whatever the database holds (a second run in
the same folder, or a campaign's shared database); the replay pass only
adds. Once a saved example's signature is known it passes on purpose, and
``MaskingDatabase`` keeps Hypothesis from deleting it.

``plain_test()`` is the same check as a plain Hypothesis test (no rounds,
no known set): what the pytest plugin hands to drivers such as HypoFuzz.
"""

from __future__ import annotations

import os
import time
import unittest
from dataclasses import dataclass, field
from typing import Any, Callable

from hypothesis import HealthCheck, Phase, Verbosity, given, seed as hseed, settings, strategies as st, target
from hypothesis.database import ExampleDatabase
from hypothesis.errors import Flaky

from harness.case import opinfo
from harness.engine.check import CaseCheck, Profile
from harness.engine.coverage import GUIDE_LABEL, Meter
from harness.engine.database import MaskingDatabase
from harness.materialize.lifetime import FrozenHeap
from harness.observation import Divergence
from harness.paths import Path
from harness.engine.result import Result, Tally
from harness.case.spec import Case
from harness.generate import MOSTLY, cases, data_variants

SHARD_STRIDE = 1_000_003
MAX_REPLAY_PASSES = 64  # distinct signatures the database's replay pass reports per target and run


def _shrink_by_count_not_time() -> None:
    """Hypothesis stops shrinking after five minutes of wall time, so on a
    loaded machine a slow path (every shrink step of a compile path compiles)
    ends with another, larger case and another signature: the verdict would
    follow the load. Our own budgets bound the run (``--minutes`` is checked
    in every example, shrink steps included); Hypothesis's count limits
    (500 successful shrinks) bound the rest."""
    from hypothesis.internal.conjecture import engine

    if getattr(engine, "MAX_SHRINKING_SECONDS", None) is not None:
        engine.MAX_SHRINKING_SECONDS = 24 * 3600


_shrink_by_count_not_time()


def _no_local_constants() -> None:
    """Hypothesis mixes literals from the source of every *local* module the
    process has imported (one outside site-packages and the stdlib) into its
    draws, a few percent of them. Our cases would then depend on which
    gradfuzz modules happen to be loaded when a target draws (what ran
    before it in this process: a different ``-n``, xdist's scheduling, the
    display thread's imports), on whether gradfuzz is an editable checkout
    or installed into site-packages, and on every literal edited anywhere in
    the harness; and on a cache under ``.hypothesis/constants`` that parallel
    workers write unlocked. Same seed, same budget: the same cases, so draws
    use Hypothesis's fixed global constants only."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - an older Hypothesis without local constants
        return
    if hasattr(providers, "_get_local_constants") and hasattr(providers, "Constants"):
        none = providers.Constants()
        providers._get_local_constants = lambda: none
        cache = getattr(providers, "CONSTANTS_CACHE", None)
        if cache is not None and hasattr(cache, "cache"):
            cache.cache.clear()  # pools computed with local constants before this import


_no_local_constants()


class Stop:
    """A cooperative stop: set in this process (a signal handler), or by
    another process creating ``file``. Cheap enough to ask per example."""

    def __init__(self, file: str | None = None) -> None:
        self.file = file
        self.requested = False
        self._next = 0.0

    def set(self) -> None:
        self.requested = True

    def __call__(self) -> bool:
        if not self.requested and self.file is not None:
            now = time.monotonic()
            if now >= self._next:
                self._next = now + 0.2
                self.requested = os.path.exists(self.file)
        return self.requested


class _Stopped(BaseException):
    """Raised inside a round to end it at once (interrupt or time up); a
    BaseException so that Hypothesis lets it through untouched."""


class _Found(AssertionError):
    pass


def strategy_flags(path: Path) -> tuple[tuple[str, object], ...]:
    """The ``cases()`` keywords a path's contract asks for."""
    return path.contract.strategy_flags()


@dataclass
class Target:
    """Paths fuzzed together on one stream of cases (one shard of it)."""

    paths: list[Path]
    exact: bool | None = None
    seed: int = 0
    shard: int = 0
    shards: int = 1  # of this target: the examples budget is split over them
    relative_to: dict[str, Path] = field(default_factory=dict)
    slack: float | None = None  # --tolerance-slack: loosen every comparison (selfcheck's proof)

    @property
    def name(self) -> str:
        return "+".join(sorted(p.name for p in self.paths))

    @property
    def mode(self) -> str:
        return {None: "both", True: "exact", False: "tolerance"}[self.exact]

    @property
    def database_key(self) -> bytes:
        """Stable across gradfuzz versions and shards: every shard (and every
        machine of a campaign) replays what any of them saved."""
        return f"gradfuzz:{self.name}:{self.mode}".encode()

    def strategy(self) -> Any:
        """The target's cases, drawn until some path of it can take one: a
        case no selected path can run is redrawn (Hypothesis filters it
        before the example counts), never spent on nothing."""
        flags: dict[str, Any] = dict(strategy_flags(self.paths[0]))
        flags.pop("variants", None)
        paths = self.paths
        if all(p.contract.input_grad for p in paths):
            flags["input_grad"] = True  # drawn in contract, not drawn and thrown away (a third of split.stock's)
        elif any(p.contract.input_grad for p in paths):
            flags["input_grad"] = MOSTLY  # split.stock beside eager: 47% of their cases had no input grad
        if not any(p.contract.random_ops for p in paths):
            flags["random_ops"] = False  # pipeline and graphed paths refuse dropout
        if not any(p.contract.retained_grads for p in paths):
            flags["retained_grads"] = False  # no retain_grad pair targets where no path compares them

        # ``takes`` twice: the generator repairs a case no path takes where it can (its grad
        # state: DeepSpeed and megatron own .grad), the filter redraws the rest.
        return cases(exact=self.exact, takes=self.takes, **flags).filter(self.takes)

    def takes(self, case: Case) -> bool:
        """Some path of the target runs the case."""
        return any(p.supports(case) is None for p in self.paths)

    @property
    def variants(self) -> int:
        """Cases checked per drawn structure (``Contract.data_variants``, equal
        for every path of a target: it is one of the strategy flags)."""
        return self.paths[0].contract.data_variants

    def examples(self) -> Any:
        """One example of the target: the drawn case, or where its paths
        compile per structure, a tuple of it and that structure's data
        variants some path runs (``harness.generate.data_variants``). A
        one-case target is ``strategy`` itself (not mapped to a tuple: a
        wrapper's label changes what Hypothesis's mutator draws, so the
        cases drawn would change with it)."""
        k = self.variants
        if k <= 1:
            return self.strategy()

        drawn = self.strategy()

        @st.composite
        def group(draw: Any) -> tuple[Case, ...]:
            first = draw(drawn)
            return tuple(c for c in draw(data_variants(first, k)) if c is first or self.takes(c))

        return group()

    def check(self, case: Case, only: Path | None = None, known: set[str] = frozenset(),  # type: ignore[assignment]
              profile: Profile | None = None, tally: Callable[[Path, str | None], None] | None = None,
              masked: list[bool] | None = None, meter: Meter | None = None,
              unjudged: Callable[[Path], None] | None = None) -> tuple[Path, list[Divergence]] | None:
        """The first path (or ``only``) with a divergence whose signature is
        not in ``known``; None when they all agree with the oracle (or
        diverge only in known ways: then ``masked`` gets a True). ``meter``
        (``--coverage``) traces each path run against its family's machinery;
        ``unjudged`` is called for each path that ran a case whose tolerance
        cannot tell a parameter grad from zero (``CaseCheck.unjudged``)."""
        cc = CaseCheck(case, slack=self.slack, lazy=True, profile=profile, meter=meter)
        todo = [(p, p.supports(case)) for p in ((only,) if only is not None else self.paths)]
        submit_ahead([p for p, reason in todo if reason is None], case)
        for p, reason in todo:
            if tally is not None:
                tally(p, reason)
            if reason is not None:
                continue
            divs = cc.run(p)
            fresh = [d for d in divs if d.signature not in known]
            if masked is not None and len(fresh) < len(divs):
                masked.append(True)
            divs = fresh
            if divs and p.name in self.relative_to:
                base = self.relative_to[p.name]
                if base.supports(case) is None and cc.run(base):
                    continue  # the base diverges too: not the injected bug
            if divs:
                return p, divs
        if unjudged is not None:
            for p, reason in todo:
                if reason is None and cc.unjudged(cc.seen.get(p.name)):
                    unjudged(p)
        return None

    def plain_test(self, database: ExampleDatabase | None = None, max_examples: int = 100,
                   on_divergence: Callable[[Path, Case, list[Divergence]], None] | None = None) -> Any:
        """One plain Hypothesis test: fails on any divergence of any path.

        With ``database`` None it takes the active profile's database, as
        coverage-guided drivers (HypoFuzz) require.
        """
        kw: dict[str, Any] = {} if database is None else {"database": database}

        @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck), **kw)
        @given(example=self.examples())
        def test_gradients_agree_with_eager(example: Case | tuple[Case, ...]) -> None:
            for case in cases_of(example):
                hit = self.check(case)
                if hit is not None:
                    path, divs = hit
                    if on_divergence is not None:
                        on_divergence(path, case, divs)
                    raise AssertionError(
                        f"{path.name} diverges from eager autograd:\n"
                        + "\n".join(f"  {d.kind} [{d.signature}] {d.detail}" for d in divs)
                    )

        test_gradients_agree_with_eager._hypothesis_internal_database_key = self.database_key  # type: ignore[attr-defined]
        return test_gradients_agree_with_eager


def cases_of(example: Case | tuple[Case, ...]) -> tuple[Case, ...]:
    """The cases of one drawn example (``Target.examples``)."""
    return example if isinstance(example, tuple) else (example,)


def submit_ahead(paths: list[Path], case: Case) -> None:
    """Start the case in the children of the paths that run it in one before
    this process computes the oracle, so the children work beside it: every
    path that says its runs may overlap (``overlaps``: the compile flavours
    on a host with cores to spare), else the first isolated one (one child
    beside this process). Results are still read in path order."""
    ahead = [p for p in paths if getattr(p, "overlaps", False)] or [p for p in paths if hasattr(p, "submit")][:1]
    for p in ahead:
        p.submit(case)


@dataclass
class Finding:
    path: Path
    case: Case
    divergences: list[Divergence]
    flaky: bool
    examples: int  # cases this target had drawn when it first failed (before shrinking)
    seconds: float
    replayed: bool = False  # found by replaying the example database, not by the seeded stream
    again: bool = False  # found by the seeded stream after this target's database replay found it


@dataclass
class _Round:
    focus: Path | None = None
    case: Case | None = None
    divs: list[Divergence] | None = None
    # Where in its example the first divergent case was: shrinking runs that
    # case of each example only (the others' data then shrink for nothing),
    # not up to ``data_variants`` cases per step.
    index: int = 0


class TargetRun:
    """One target's session: rounds until the budget is spent or a stop.

    ``examples``: cases to draw (each goes to every path of the target);
    ``deadline``: a ``time.monotonic()`` value; ``on_finding`` is called as
    soon as a finding is confirmed (the caller saves it); ``heartbeat`` at
    most every ``beat`` seconds while running (status files, live display).
    """

    replaying = False  # in the database's replay pass: nothing is drawn or counted as an example

    def __init__(self, target: Target, result: Result, *, examples: int | None = None,
                 deadline: float | None = None, database: ExampleDatabase | None = None,
                 stop: Stop | None = None, on_finding: Callable[[Finding], None] | None = None,
                 heartbeat: Callable[[], None] | None = None, beat: float = 0.5, chunk: int = 200,
                 detect_only: bool = False, record: list[Case] | None = None,
                 until_kinds: tuple[str, ...] | None = None, meter: Meter | None = None,
                 guide: bool = False, settled: Callable[[str, str], bool] | None = None) -> None:
        self.target = target
        self.result = result
        self.examples = examples
        self.deadline = deadline
        self.database = MaskingDatabase(database) if database is not None else None
        self.stop = stop or Stop()
        self.on_finding = on_finding
        self.heartbeat = heartbeat
        self.beat = beat
        self.chunk = chunk
        # detect_only: stop at the first failing example, unshrunk (time-to-detection statistics);
        # record: every drawn case is appended (the benchmark re-times them phase by phase).
        self.detect_only = detect_only
        # until_kinds: no shrinking, and fuzzing ends at the first confirmed
        # finding of one of these kinds (the self-check: a canary is caught
        # by its first finding of the kinds its bug makes; shrinking it and
        # drawing on for other signatures decide nothing there).
        self.until_kinds = until_kinds
        self.record = record
        # settled(path, signature): the ledger already places that signature on that
        # path here; a first hit whose every divergence is settled is kept as drawn,
        # not shrunk (the gate: its row is judged on the drawn case, and every
        # shrink step of a compile path compiles again).
        self.settled = settled
        # --coverage: ``meter`` traces the drawn examples' path runs (not shrink steps, not the
        # database's replay pass, not the confirming re-run: their number follows the bug, and
        # the coverage of N examples must be a function of the N examples); ``guide`` hands
        # each example's new lines to Hypothesis's ``target()``.
        self.meter = meter
        self.guide = guide and meter is not None
        self.known: set[str] = set()
        self.drawn = 0
        self.profile = Profile()
        self.findings: list[Finding] = []
        self.interrupted = False
        self.started = time.monotonic()
        self._next_beat = 0.0
        self.tallies = {p.name: result.paths.setdefault(p.name, Tally()) for p in target.paths}
        for t in self.tallies.values():
            t.per_example = target.variants
        # A worker may run several shards of one target: its seconds add up.
        self._seconds0 = {name: t.seconds for name, t in self.tallies.items()}
        self.heap: FrozenHeap | None = None  # set while ``run`` runs
        self._ops: set[str] = set()  # the OpInfo ops of the case being checked

    # -- the per-example body ------------------------------------------------

    def _tally(self, path: Path, reason: str | None) -> None:
        t = self.tallies[path.name]
        if self.replaying:
            t.replayed += 1
            return
        t.examples += 1
        if reason is None:
            t.run += 1
            t.ops.update(self._ops)
        else:
            t.skipped[reason] = t.skipped.get(reason, 0) + 1

    def _unjudged(self, path: Path) -> None:
        if not self.replaying:
            self.tallies[path.name].unjudged += 1

    def _body(self, example: Case | tuple[Case, ...], rnd: _Round) -> None:
        """One drawn example: its cases in turn (one, or a structure's data
        variants), each through every path; the first new divergence ends it."""
        group = cases_of(example)
        now = time.monotonic()
        if self.stop():
            self.interrupted = True
            raise _Stopped()
        if self.deadline is not None and now >= self.deadline:
            raise _Stopped()
        if self.heartbeat is not None and now >= self._next_beat:
            self._next_beat = now + self.beat
            self._update_seconds(now)
            self.heartbeat()
        if self.database is not None:
            self.database.masked = False
        drawing = rnd.focus is None and not self.replaying
        if drawing:
            self.drawn += 1
        masked: list[bool] = []
        new = 0
        # Shrinking re-runs the focus path: those runs are not examples (a racy
        # bug shrinks in more or fewer steps, and the counts would follow it).
        meter = self.meter if drawing else None
        hit = None
        if rnd.focus is not None:
            group = group[rnd.index:rnd.index + 1]
        for i, case in enumerate(group):
            if rnd.focus is None:
                rnd.index = i
            if drawing and self.record is not None:
                self.record.append(case)
            hit, lines = self._check(case, rnd, masked, meter)
            new += lines
            if hit is not None:
                break
        if hit is None and masked and self.database is not None:
            self.database.masked = True  # passing only because its signature is known: keep it saved
        if meter is not None and self.guide:
            # The count of machinery lines no earlier example of this process reached: Hypothesis
            # keeps the best-scoring example and its optimiser mutates it, so the draws climb
            # from the examples that opened new code (a plain function of the case and of the
            # examples before it, so a run in one process stays deterministic).
            target(float(new), label=GUIDE_LABEL)
        if hit is not None:
            self._hit(case, hit, rnd)

    def _check(self, case: Case, rnd: _Round, masked: list[bool],
               meter: Meter | None) -> tuple[tuple[Path, list[Divergence]] | None, int]:
        """One case through the target's paths (the focus path only while
        shrinking): its hit, and the machinery lines it was the first to reach."""
        if self.heap is not None:
            self.heap.between_cases()
        t0 = time.process_time()
        self._ops = opinfo.ops_in(case)
        tally = self._tally if rnd.focus is None else None
        try:
            hit = self.target.check(case, rnd.focus, self.known, self.profile, tally, masked, meter,
                                    self._unjudged if tally is not None else None)
        finally:
            self.profile.body += time.process_time() - t0
            self.profile.cases += 1
            new = meter.example_done()[0] if meter is not None else 0
        return hit, new

    def _hit(self, case: Case, hit: tuple[Path, list[Divergence]], rnd: _Round) -> None:
        """A new divergence: remember it and end the example (to shrink it, or
        to stop at once where shrinking decides nothing)."""
        path, divs = hit
        # A hang costs the path's whole timeout and a restart of its workers
        # on every try, so a hang is not shrunk (a shrink whose step hangs
        # keeps what it had): each new hang costs two timeouts, where
        # Hypothesis's 500 shrinks bounded it by hours. A timeout's
        # signature does not depend on the case's shape.
        hang = not self.replaying and any(d.kind == "timeout" for d in divs)
        if hang and rnd.focus is not None:
            raise _Stopped()
        keep = hang or rnd.focus is None and self.settled is not None and all(
            self.settled(path.name, d.signature) for d in divs)
        if rnd.focus is None:
            t = self.tallies[path.name]
            if t.first_hit_examples is None and not self.replaying:  # from this path's cold start
                t.first_hit_examples = self.drawn
                t.first_hit_seconds = time.monotonic() - self.started
            rnd.focus = path
            self._first = (self.drawn, time.monotonic() - self.started)
        rnd.case, rnd.divs = case, divs
        if self.detect_only or self.until_kinds is not None or keep:
            raise _Stopped()
        raise _Found(divs[0].detail)

    def _update_seconds(self, now: float | None = None) -> None:
        s = (now or time.monotonic()) - self.started
        for name, t in self.tallies.items():
            t.seconds = self._seconds0[name] + s

    # -- rounds ---------------------------------------------------------------

    def _settings(self, max_examples: int, phases: tuple[Phase, ...]) -> Any:
        return settings(max_examples=max_examples, database=self.database, deadline=None, verbosity=Verbosity.quiet,
                        suppress_health_check=list(HealthCheck), phases=phases, report_multiple_bugs=False)

    def _replay_saved(self) -> bool:
        """The database's saved examples for this target, before any round:
        one pass per signature they show (each found is known to the next
        pass), until a pass shows nothing new. Their finds are reported like
        any other; they count as ``replayed``, not as examples, and what they
        made known is forgotten afterwards, so the seeded rounds draw, shrink
        and find exactly as from a cold start. False: told to stop."""
        if self.database is None or self.detect_only:
            return True
        target = self.target
        self.replaying = True
        try:
            for _ in range(MAX_REPLAY_PASSES):
                if self.stop():
                    self.interrupted = True
                    return False
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    return False
                rnd = _Round()

                # No shrink phase: what the database keeps is what earlier runs shrank to.
                @self._settings(self.chunk, (Phase.reuse,))
                @hseed(target.seed * 100_003 + target.shard * SHARD_STRIDE)
                @given(target.examples())
                def replay_saved(example: Case | tuple[Case, ...]) -> None:
                    self._body(example, rnd)

                replay_saved._hypothesis_internal_database_key = target.database_key  # type: ignore[attr-defined]
                try:
                    replay_saved()
                except _Stopped:
                    return False
                except (_Found, Flaky):
                    pass
                except unittest.SkipTest:  # nothing saved under this target's key
                    break
                if rnd.case is None:
                    break
                self._confirm_and_record(rnd)
        finally:
            self.replaying = False
            self.known = set()
        return True

    def run(self) -> list[Finding]:
        """The rounds, the heap frozen before each case (``FrozenHeap``:
        a full collection in a case walks only what the case made)."""
        with FrozenHeap() as self.heap:
            try:
                return self._rounds()
            finally:
                self.heap = None  # ``_rounds`` left the seconds final
                for t in self.tallies.values():
                    t.finished += 1

    def _rounds(self) -> list[Finding]:
        target = self.target
        round_no = 0
        try:
            if not self._replay_saved():
                return self.findings
            while not self.stop():
                left = None if self.examples is None else self.examples - self.drawn
                if left is not None and left <= 0:
                    break
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    break
                budget = min(self.chunk, left) if left is not None else self.chunk
                rnd = _Round()

                # No reuse phase: the database was replayed apart (``_replay_saved``);
                # found failures are still saved to it for the next run.
                @self._settings(budget, (Phase.generate, Phase.target, Phase.shrink))
                @hseed(target.seed * 100_003 + target.shard * SHARD_STRIDE + round_no)
                @given(target.examples())
                def fuzz_round(example: Case | tuple[Case, ...]) -> None:
                    self._body(example, rnd)

                fuzz_round._hypothesis_internal_database_key = target.database_key  # type: ignore[attr-defined]
                before = self.drawn
                stopped = False
                try:
                    fuzz_round()
                except _Stopped:
                    # A hit in a detecting run ends its round at once: not a stop. (The
                    # loop's head asks stop() and the deadline again either way.)
                    stopped = rnd.case is None
                except (_Found, Flaky):
                    pass
                if rnd.case is not None:
                    self._confirm_and_record(rnd)
                round_no += 1
                if self.detect_only and self.findings or self._until_met():
                    break
                if stopped or (self.drawn == before and rnd.case is None):
                    break  # the stream is exhausted (tiny strategies), or we were told to stop
        finally:
            self._update_seconds()
            # The database's finds that the seeded stream did not make again: what the
            # database adds to a cold start (the stream's own finds keep their place).
            self.result.divergences.extend(d for f in self.replay_only() for d in f.divergences)
        return self.findings

    def _until_met(self) -> bool:
        return self.until_kinds is not None and any(
            not f.flaky and d.kind in self.until_kinds for f in self.findings for d in f.divergences)

    def replay_only(self) -> list["Finding"]:
        """Finds of the database's replay pass that the seeded stream did not make."""
        again = {(f.path.name, f.divergences[0].signature) for f in self.findings if not f.replayed}
        return [f for f in self.findings if f.replayed and (f.path.name, f.divergences[0].signature) not in again]

    def _confirm_and_record(self, rnd: _Round) -> None:
        assert rnd.case is not None and rnd.divs is not None and rnd.focus is not None
        case, divs, path = rnd.case, rnd.divs, rnd.focus
        again = self.target.check(case, path, self.known)
        flaky = again is None
        for d in divs:
            d.case = case.to_json()
            d.flaky = flaky
            self.known.add(d.signature)
        if again is not None:
            self.known.update(d.signature for d in again[1])
        if flaky and all(d.kind == "crash" for d in divs):
            # A worker that died once and not on the re-run was killed from outside
            # the case (by the harness, a signal, the OOM killer): the harness's error,
            # not a finding against the path.
            self.result.errors.append(f"{path.name}: harness error, not a finding: a worker died once and the re-run "
                                      f"of the same case did not (killed from outside?): {divs[0].detail[:300]}")
            return
        if not self.replaying:  # the replay pass's finds join at the end, where the stream did not make them
            self.result.divergences.extend(divs)
        examples, seconds = getattr(self, "_first", (self.drawn, time.monotonic() - self.started))
        again = not self.replaying and any(x.replayed and x.divergences[0].signature == divs[0].signature
                                           for x in self.findings)
        f = Finding(path, case, divs, flaky, examples, seconds, replayed=self.replaying, again=again)
        self.findings.append(f)
        if self.on_finding is not None:
            self.on_finding(f)
