"""How often would tolerance mode let a zeroed parameter grad agree?

    PYTHONPATH=. python benchmarks/tolerance_floor.py PATH [EXAMPLES] [SEED]

Draws PATH's cases (its target's strategy, seeded), keeps those in its
contract and in tolerance mode, and asks of each parameter grad after the
first backward (float64 eager) whether every element is within what
``Tolerance.allowed`` lets it differ by (``eps`` times the element's term
bound, plus ``eps * 1e-3 * peak``, ``peak`` the largest term bound anywhere
in the case). Where it is, a path that left the grad zero (or doubled it,
or read another parameter's) would agree. Prints the counts, and the
median, 90th percentile and maximum of the floor ``eps * 1e-3 * peak`` over
each grad's largest element (how much of that is the floor's doing).
"""

from __future__ import annotations

import sys

from hypothesis import HealthCheck, Phase, given, seed, settings

from harness.compare.values import Tolerance
from harness.engine.target import Target
from harness.paths import resolve
from oracles.eager import observe


def main() -> None:
    path = resolve(sys.argv[1])[0]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    counts = {"in contract": 0, "exact": 0, "tolerance": 0, "a zeroed grad agrees": 0, "every zeroed grad agrees": 0}
    ratios: list[float] = []

    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), phases=(Phase.generate,),
              database=None)
    @seed(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    @given(Target([path]).strategy())
    def draw(case) -> None:  # type: ignore[no-untyped-def]
        if path.supports(case) is not None:
            return
        counts["in contract"] += 1
        tol = Tolerance.for_case(case)
        if tol.exact:
            counts["exact"] += 1
            return
        counts["tolerance"] += 1
        floor = tol.eps * 1e-3 * tol.peak
        grads = {n: g for n, g in observe(case).steps[0].grads.items()
                 if g is not None and g.numel() and float(g.abs().max()) > 0}
        hidden = [bool((g.abs() <= tol.allowed(n, g.shape)).all()) for n, g in grads.items()]
        ratios.extend(floor / float(g.abs().max()) for g in grads.values())
        counts["a zeroed grad agrees"] += any(hidden)
        counts["every zeroed grad agrees"] += bool(hidden) and all(hidden)

    draw()
    r = sorted(ratios)
    at = (lambda q: f"{r[min(int(q * len(r)), len(r) - 1)]:.3g}") if r else (lambda q: "-")
    print(f"{path.name}: {counts}; floor / max|grad|: median {at(0.5)}, p90 {at(0.9)}, max {at(1.0)}")


if __name__ == "__main__":
    main()
