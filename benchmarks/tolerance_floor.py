"""How often would tolerance mode let a wrong parameter grad agree?

    PYTHONPATH=. python benchmarks/tolerance_floor.py PATH [EXAMPLES] [SEED] [--terms-only] [--low-only]

Draws PATH's cases (its target's strategy, seeded), keeps those in its
contract and in tolerance mode, and asks of each parameter grad whether a
path that got it wrong in one of four ways would still agree
(``harness.compare.values.blind_to``, the rule that counts a case
unjudged): zeroed, halved, sign-flipped (after the first
backward), or one microbatch's contribution dropped (after the last
backward of a step of several). ``--terms-only`` judges with the term
bounds alone (the tolerance before the float32 noise cap, and a path that
rounds grads to a lower type against term sizes, not against what it
rounded), for a before and after in one run. ``--low-only`` keeps only the
cases the path computes in a lower type (its ``rounding``). Prints the counts, and the median, 90th percentile and
maximum of the floor ``eps * 1e-3 * peak`` over each grad's largest element.
"""

from __future__ import annotations

import sys

from hypothesis import HealthCheck, Phase, given, seed, settings

from harness.compare.values import Tolerance, blind_to
from harness.engine.check import CaseCheck
from harness.engine.target import Target
from harness.paths import resolve
from oracles.eager import observe

WRONGS = ("zeroed", "halved", "flipped", "dropped")


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    terms_only = "--terms-only" in sys.argv
    low_only = "--low-only" in sys.argv
    path, eager = resolve(args[0])[0], resolve("eager.accumulate")[0]
    n = int(args[1]) if len(args) > 1 else 300
    counts = {"in contract": 0, "exact": 0, "tolerance": 0, "low precision": 0, "a wrong grad agrees": 0,
              **{f"a {w} grad agrees": 0 for w in WRONGS}}
    ratios: list[float] = []

    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), phases=(Phase.generate,),
              database=None)
    @seed(int(args[2]) if len(args) > 2 else 1)
    @given(Target([path]).strategy())
    def draw(case) -> None:  # type: ignore[no-untyped-def]
        if path.supports(case) is not None:
            return
        if low_only and not (hasattr(path, "rounding") and path.rounding(case)[0]):
            return
        counts["in contract"] += 1
        precision, rounded = path.rounding(case) if hasattr(path, "rounding") else (None, None)
        tol = Tolerance.for_case(case)
        if tol.exact and precision is None:
            counts["exact"] += 1
            return
        counts["tolerance"] += 1
        counts["low precision"] += precision is not None
        oracle = observe(case)
        if not terms_only:
            tol = tol.with_noise(case, oracle, lambda: eager.run(case) if eager.supports(case) is None else None,
                                 CaseCheck(case)._eager_low)
        tol = tol.lowered(precision, case, None if terms_only else rounded)
        hidden = blind_to(tol, oracle, case.schedule.microbatches, case.dtype)
        counts["a wrong grad agrees"] += bool(hidden)
        for w in hidden:
            counts[f"a {w} grad agrees"] += 1
        floor = tol.eps * 1e-3 * tol.peak
        ratios.extend(floor / float(g.abs().max()) for g in oracle.steps[0].grads.values()
                      if g is not None and g.numel() and float(g.abs().max()) > 0)

    draw()
    r = sorted(ratios)
    at = (lambda q: f"{r[min(int(q * len(r)), len(r) - 1)]:.3g}") if r else (lambda q: "-")
    print(f"{path.name}{' (term bounds only)' if terms_only else ''}: {counts}; "
          f"floor / max|grad|: median {at(0.5)}, p90 {at(0.9)}, max {at(1.0)}")


if __name__ == "__main__":
    main()
