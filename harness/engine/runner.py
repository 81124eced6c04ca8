"""Checking, replay, and the small fuzzing entry points of the public API.

The fuzzing engine itself is ``harness.engine.target`` (rounds of Hypothesis per
target, shrinking against the path that failed, confirmation, known
signatures) driven by ``harness.engine.session``; ``fuzz`` and ``fuzz_path`` here
are thin fronts to it, so the gate, selfcheck, the tests and
``gradfuzz fuzz`` all fuzz the same way.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable

from harness.out import corpus
from harness.out import repro
from harness.compare.values import Tolerance, compare
from harness.observation import Divergence
from harness.paths import Path
from harness.case.spec import Case
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


def _machinery(path: Path) -> tuple[str, str] | None:
    source = getattr(path, "repro_source", None)
    return source() if callable(source) else None


def save_finding(save_dir: str, path: Path, case: Case, divs: list[Divergence], source: str) -> str:
    """Save one finding, de-duplicated by signature (``harness.out.findings``)."""
    from harness.out import findings

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
    relative_to: Path | None = None,
) -> None:
    """Fuzz one path alone, from a cold start (no database); ``relative_to``
    counts only cases where that path agrees with the oracle (a fork judged
    against the implementation it forked, a canary against its base)."""
    from harness.engine.target import Target, TargetRun

    def on_finding(f) -> None:
        if save_dir:
            source = f"gradfuzz fuzz --paths {path.name} --seed {seed}"
            result.saved.append(save_finding(save_dir, path, f.case, f.divergences, source))
        first = f.divergences[0]
        progress(f"[{path.name}] divergence {first.signature}: {first.detail}{' (FLAKY: did not reproduce)' if f.flaky else ''}")

    target = Target([path], exact=exact, seed=seed, relative_to={path.name: relative_to} if relative_to is not None else {})
    TargetRun(target, result, examples=examples, deadline=deadline, on_finding=on_finding).run()


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
    """An in-process fuzzing session over ``paths`` (what ``gradfuzz fuzz`` runs without ``-n``)."""
    from harness.engine import session

    return session.fuzz(paths, examples=examples, minutes=minutes, seed=seed, save_dir=save_dir, exact=exact,
                        on_event=progress).result


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
