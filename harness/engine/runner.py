"""The public entry points: fuzz, fuzz one path, replay (``harness.fuzz`` ...).

The fuzzing engine itself is ``harness.engine.target`` (rounds of Hypothesis per
target, shrinking against the path that failed, confirmation, known
signatures) driven by ``harness.engine.session``; ``fuzz`` and ``fuzz_path`` here
are thin fronts to it, so the gate, selfcheck, the tests and
``gradfuzz fuzz`` all fuzz the same way.
"""

from __future__ import annotations

import sys
from typing import Callable, Iterable

from harness.engine.check import check, replay_entries
from harness.engine.result import Result, Tally
from harness.artifacts import corpus
from harness.artifacts.findings import save_finding
from harness.paths import Path, close_paths, split_available

__all__ = ["Result", "Tally", "check", "fuzz", "fuzz_path", "replay"]


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
    slack: float | None = None,
    detect_only: bool = False,
    until_kinds: tuple[str, ...] | None = None,
) -> None:
    """Fuzz one path alone, from a cold start (no database); ``relative_to``
    counts only cases where that path agrees with the oracle (a fork judged
    against the implementation it forked, a canary against its base);
    ``detect_only`` stops at the first failing example, unshrunk;
    ``until_kinds`` never shrinks and stops at the first confirmed finding of those kinds."""
    from harness.engine.target import Target, TargetRun

    def on_finding(f) -> None:
        if save_dir:
            source = f"gradfuzz fuzz --paths {path.name} --seed {seed}"
            result.saved.append(save_finding(save_dir, path, f.case, f.divergences, source))
        first = f.divergences[0]
        progress(f"[{path.name}] divergence {first.signature}: {first.detail}{' (FLAKY: did not reproduce)' if f.flaky else ''}")

    target = Target([path], exact=exact, seed=seed, relative_to={path.name: relative_to} if relative_to is not None else {},
                    slack=slack)
    TargetRun(target, result, examples=examples, deadline=deadline, on_finding=on_finding, detect_only=detect_only,
              until_kinds=until_kinds).run()


def fuzz(
    paths: list[Path],
    *,
    examples: int | None = None,
    minutes: float | None = None,
    seed: int = 0,
    save_dir: str | None = None,
    exact: bool | None = None,
    progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
    slack: float | None = None,
    settled: Callable[[str, str], bool] | None = None,
) -> Result:
    """An in-process fuzzing session over ``paths`` (what ``gradfuzz fuzz`` runs without ``-n``);
    ``settled``: which first hits stay unshrunk (``TargetRun``)."""
    from harness.engine import session

    return session.fuzz(paths, examples=examples, minutes=minutes, seed=seed, save_dir=save_dir, exact=exact,
                        on_event=progress, slack=slack, settled=settled).result


def replay(
    files: Iterable[str],
    paths: list[Path],
    progress: Callable[[str], None] = lambda s: None,
    slack: float | None = None,
    each: Callable[..., None] | None = None,
) -> Result:
    """Every corpus case on every available path whose contract takes it;
    ``each(replayed)`` sees every run (``gradfuzz replay`` counts them)."""
    import torch

    result = Result()
    entries = [corpus.load(f) for f in files]  # all parse errors surface before any run
    live, result.unavailable = split_available(paths)
    try:
        for r in replay_entries(entries, live, slack):
            tally = result.paths.setdefault(r.path.name, Tally())
            tally.examples += 1
            if each is not None:
                each(r)
            if r.skipped is not None:
                tally.skipped[r.skipped] = tally.skipped.get(r.skipped, 0) + 1
                continue
            tally.run += 1
            for d in r.divergences:
                d.detail = f"{r.entry.file}: {d.detail}"
            known = r.divergences and r.entry.expected_on(r.path.name, torch.__version__)
            (result.expected if known else result.divergences).extend(r.divergences)
            progress(f"[{r.path.name}] {r.entry.file}: {'ok' if not r.divergences else f'{len(r.divergences)} divergence(s)'}")
    finally:
        close_paths(live)
    return result
