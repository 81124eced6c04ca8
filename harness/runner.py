"""Fuzzing and replay: cases through paths, divergences out.

Each path is fuzzed by its own Hypothesis run, so a failure shrinks against
the path that showed it. A fuzz run is a series of rounds; a round stops at
its first new failure, which Hypothesis shrinks; the shrunk case is re-run
to confirm it, saved, and its signatures join the known set so the next
round looks for something else.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from hypothesis import HealthCheck, Phase, Verbosity, given, seed as hseed, settings
from hypothesis.errors import Flaky

from harness import corpus, repro
from harness.compare import Tolerance, compare
from harness.observation import Divergence
from harness.paths import Path
from harness.spec import Case
from harness.strategies import cases
from oracles.eager import observe


@dataclass
class Tally:
    examples: int = 0
    run: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    # Time to detection: examples and seconds until the first failing example
    # (before shrinking), from this path's cold start.
    first_hit_examples: int | None = None
    first_hit_seconds: float | None = None


@dataclass
class Result:
    paths: dict[str, Tally] = field(default_factory=dict)
    divergences: list[Divergence] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)
    saved: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    expected: list[Divergence] = field(default_factory=list)  # known bugs on this torch

    @property
    def examples(self) -> int:
        return sum(t.examples for t in self.paths.values())


def check(case: Case, path: Path, oracle=None, tol: Tolerance | None = None) -> list[Divergence]:
    """Run one case on one path; the case must be inside the path's contract."""
    oracle = oracle or observe(case)
    obs = path.run(case)
    return compare(case, oracle, obs, path.contract, tol)


class _Found(AssertionError):
    pass


def _machinery(path: Path) -> tuple[str, str] | None:
    source = getattr(path, "repro_source", None)
    return source() if callable(source) else None


def save_finding(save_dir: str, path: Path, case: Case, divs: list[Divergence], source: str) -> str:
    """Save one finding, de-duplicated by signature (``harness.findings``)."""
    from harness import findings

    entry, text = finding_entry(path, case, divs, source)
    return findings.record(save_dir, divs[0].signature, entry, text).file


def finding_entry(path: Path, case: Case, divs: list[Divergence], source: str) -> tuple[corpus.Entry, str]:
    """A finding as a corpus entry and its standalone repro script."""
    import torch

    first = divs[0]
    meta = {
        "title": f"{path.name}: {first.detail.split(';')[0]}",
        "source": source,
        "found_with": {"torch": torch.__version__, "path": path.name},
        "signature": first.signature,
        "flaky": any(d.flaky for d in divs),
        "divergences": [{k: v for k, v in d.to_json().items() if k != "case"} for d in divs],
    }
    entry = corpus.Entry(case, meta)
    text = repro.script(case, path.name, _machinery(path), title=meta["title"])
    return entry, text


def fuzz_path(
    path: Path,
    *,
    examples: int | None,
    deadline: float | None,
    seed: int,
    result: Result,
    save_dir: str | None,
    exact: bool | None = None,
    progress: Callable[[str], None] = lambda s: None,
    chunk: int = 200,
    relative_to: Path | None = None,
) -> None:
    """Fuzz one path; ``relative_to`` counts only cases where that path agrees
    with the oracle (a fork judged against the implementation it forked)."""
    tally = result.paths.setdefault(path.name, Tally())
    known: set[str] = set()
    start = time.monotonic()
    round_no = 0
    while True:
        left = None if examples is None else examples - tally.examples
        if left is not None and left <= 0:
            break
        if deadline is not None and time.monotonic() >= deadline:
            break
        budget = min(chunk, left) if left is not None else chunk
        last: dict[str, object] = {}

        @settings(
            max_examples=budget,
            database=None,
            deadline=None,
            verbosity=Verbosity.quiet,
            suppress_health_check=list(HealthCheck),
            phases=(Phase.generate, Phase.target, Phase.shrink),
            report_multiple_bugs=False,
        )
        @hseed(seed * 100_003 + round_no)
        @given(cases(exact=exact, lifetime=getattr(path.contract, "lifetime_schedules", False),
                     dtensor=getattr(path.contract, "dtensor_placements", False),
                     pipeline=tuple(getattr(path.contract, "pipeline_layouts", ()))))
        def target(case: Case) -> None:
            reason = path.supports(case)
            if reason is not None:
                tally.skipped[reason] = tally.skipped.get(reason, 0) + 1
                return
            divs = [d for d in check(case, path) if d.signature not in known]
            if divs and relative_to is not None and relative_to.supports(case) is None and check(case, relative_to):
                return
            if divs:
                if tally.first_hit_examples is None:
                    tally.first_hit_examples = tally.examples
                    tally.first_hit_seconds = time.monotonic() - start
                last["case"], last["divs"] = case, divs
                raise _Found(divs[0].detail)

        counted = _Counting(target, tally)
        try:
            counted()
        except (_Found, Flaky) as e:
            case, divs = last["case"], last["divs"]  # the last failing call is the shrunk one
            again = [d for d in check(case, path) if d.signature not in known]  # type: ignore[arg-type]
            flaky = isinstance(e, Flaky) or not again
            for d in divs:  # type: ignore[union-attr]
                d.case = case.to_json()  # type: ignore[union-attr]
                d.flaky = flaky
                known.add(d.signature)
            result.divergences.extend(divs)  # type: ignore[arg-type]
            if save_dir:
                result.saved.append(save_finding(save_dir, path, case, divs, f"gradfuzz fuzz --paths {path.name} --seed {seed}"))  # type: ignore[arg-type]
            progress(f"[{path.name}] divergence {divs[0].signature}: {divs[0].detail}{' (FLAKY: did not reproduce)' if flaky else ''}")  # type: ignore[index]
        round_no += 1
        tally.seconds = time.monotonic() - start
        found = sum(1 for d in result.divergences if d.path == path.name)
        progress(
            f"[{path.name}] {tally.examples} examples ({tally.run} run, {sum(tally.skipped.values())} outside contract), "
            f"{tally.seconds:.1f}s, {found} divergence(s)"
        )


class _Counting:
    """Counts examples through a wrapper, since Hypothesis does not report them."""

    def __init__(self, test, tally: Tally) -> None:
        self.test, self.tally = test, tally
        inner = test.hypothesis.inner_test

        def counting(case: Case) -> None:
            tally.examples += 1
            before = sum(tally.skipped.values())
            try:
                inner(case)
            finally:
                if sum(tally.skipped.values()) == before:
                    tally.run += 1

        test.hypothesis.inner_test = counting

    def __call__(self) -> None:
        self.test()


def fuzz(
    paths: list[Path],
    *,
    examples: int | None = None,
    minutes: float | None = None,
    seed: int = 0,
    save_dir: str | None = None,
    exact: bool | None = None,
    progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> Result:
    result = Result()
    live, result.unavailable = split_available(paths)
    for name, why in result.unavailable.items():
        progress(f"[{name}] not run: unavailable ({why})")
    if examples is None and minutes is None:
        examples = 100
    start = time.monotonic()
    try:
        for i, p in enumerate(live):
            deadline = None
            if minutes is not None:
                # Split what is left of the budget evenly over the paths still to run.
                share = (minutes * 60 - (time.monotonic() - start)) / (len(live) - i)
                deadline = time.monotonic() + max(share, 0.0)
            fuzz_path(p, examples=examples, deadline=deadline, seed=seed, result=result, save_dir=save_dir,
                      exact=exact, progress=progress)
    finally:
        close_paths(paths)
    return result


def split_available(paths: list[Path]) -> tuple[list[Path], dict[str, str]]:
    """The paths that can run here, and why each other one cannot."""
    live, unavailable = [], {}
    for p in paths:
        a = p.availability()
        if a.ok:
            live.append(p)
        else:
            unavailable[p.name] = a.reason
    return live, unavailable


def close_paths(paths: list[Path]) -> None:
    """Paths that own processes or devices release them here (optional ``close``)."""
    for p in paths:
        close = getattr(p, "close", None)
        if callable(close):
            close()


def replay(
    files: Iterable[str],
    paths: list[Path],
    progress: Callable[[str], None] = lambda s: None,
) -> Result:
    """Every corpus case on every available path whose contract takes it."""
    import torch

    result = Result()
    entries = [corpus.load(f) for f in files]  # all parse errors surface before any run
    live, result.unavailable = split_available(paths)
    try:
        _replay_entries(entries, live, result, progress)
    finally:
        close_paths(live)
    return result


def _replay_entries(entries, live, result: Result, progress) -> None:
    import torch

    for entry in entries:
        oracle = observe(entry.case)
        tol = Tolerance.for_case(entry.case)
        for p in live:
            tally = result.paths.setdefault(p.name, Tally())
            tally.examples += 1
            reason = p.supports(entry.case)
            if reason is not None:
                tally.skipped[reason] = tally.skipped.get(reason, 0) + 1
                continue
            tally.run += 1
            divs = check(entry.case, p, oracle, tol)
            for d in divs:
                d.case = entry.case.to_json()
                d.detail = f"{entry.file}: {d.detail}"
            if divs and entry.expected_on(p.name, torch.__version__):
                result.expected.extend(divs)
            else:
                result.divergences.extend(divs)
            progress(f"[{p.name}] {entry.file}: {'ok' if not divs else f'{len(divs)} divergence(s)'}")
