"""Does the harness still catch its canaries on this installation?

Run first by ``gradfuzz gate``: after a torch upgrade, a harness that lost
its teeth (a comparison that stopped comparing, a generator that stopped
producing tied weights) must fail loudly rather than pass every path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


from harness.canaries import Canary, all_canaries
from harness.engine.runner import Result, fuzz_path


@dataclass
class CanaryResult:
    name: str
    caught: bool
    examples: int | None
    seconds: float
    detail: str
    skipped: str = ""


def run_canary(c: Canary, seed: int = 0, slack: float | None = None) -> CanaryResult:
    path = c.make()
    available = path.availability()
    if not available.ok:
        return CanaryResult(c.name, False, None, 0.0, "", skipped=f"unavailable here: {available.reason}")
    base, note, skipped = c.resolve_base()
    if skipped:
        return CanaryResult(c.name, False, None, 0.0, "", skipped=skipped)
    result = Result()
    start = time.monotonic()
    try:
        fuzz_path(path, examples=c.budget, deadline=None, seed=seed, result=result, save_dir=None, relative_to=base,
                  slack=slack, detect_only=not c.shrink)
    finally:
        close = getattr(path, "close", None)
        if callable(close):
            close()
    tally = result.paths[path.name]
    d = result.divergences[0] if result.divergences else None
    detail = d.detail if d else f"not caught in {c.budget} examples ({tally.run} in contract)"
    return CanaryResult(c.name, d is not None, tally.first_hit_examples, time.monotonic() - start,
                        f"{detail}; {note}" if note else detail)


def selfcheck(seed: int = 0, progress=lambda s: None, slack: float | None = None) -> list[CanaryResult]:
    """``slack`` loosens every comparison: proof that a blunted harness fails here."""
    out = []
    for c in all_canaries():
        r = run_canary(c, seed, slack)
        progress(f"[selfcheck] {c.name}: " + (r.skipped and f"skipped ({r.skipped})" or
                                                ("caught" if r.caught else "NOT CAUGHT") + f" ({r.examples} examples, {r.seconds:.1f}s)"))
        out.append(r)
    return out
