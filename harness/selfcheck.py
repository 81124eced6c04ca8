"""Does the harness still catch its canaries on this installation?

Run first by ``gradfuzz gate``: after a torch upgrade, a harness that lost
its teeth (a comparison that stopped comparing, a generator that stopped
producing tied weights) must fail loudly rather than pass every path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from packaging.version import Version

from harness.canaries import Canary, all_canaries
from harness.paths import resolve
from harness.runner import Result, fuzz_path


@dataclass
class CanaryResult:
    name: str
    caught: bool
    examples: int | None
    seconds: float
    detail: str
    skipped: str = ""


def _has_clamp() -> bool:
    return Version(torch.__version__.split("+")[0]) >= Version("2.13")


def run_canary(c: Canary, seed: int = 0) -> CanaryResult:
    if c.needs_clamp and not _has_clamp():
        return CanaryResult(c.name, False, None, 0.0, "", skipped="stock split before 2.13 double counts itself; no clean base")
    path = c.make()
    available = path.availability()
    if not available.ok:
        return CanaryResult(c.name, False, None, 0.0, "", skipped=f"unavailable here: {available.reason}")
    base = resolve(c.base)[0] if c.base else None
    result = Result()
    start = time.monotonic()
    try:
        fuzz_path(path, examples=c.budget, deadline=None, seed=seed, result=result, save_dir=None, relative_to=base)
    finally:
        close = getattr(path, "close", None)
        if callable(close):
            close()
    tally = result.paths[path.name]
    d = result.divergences[0] if result.divergences else None
    return CanaryResult(c.name, d is not None, tally.first_hit_examples, time.monotonic() - start,
                        d.detail if d else f"not caught in {c.budget} examples")


def selfcheck(seed: int = 0, progress=lambda s: None) -> list[CanaryResult]:
    out = []
    for c in all_canaries():
        r = run_canary(c, seed)
        progress(f"[selfcheck] {c.name}: " + (r.skipped and f"skipped ({r.skipped})" or
                                                ("caught" if r.caught else "NOT CAUGHT") + f" ({r.examples} examples, {r.seconds:.1f}s)"))
        out.append(r)
    return out
