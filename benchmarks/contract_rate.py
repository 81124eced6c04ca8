"""How many generated cases a path fuzzed alone cannot take, and why.

    PYTHONPATH=. python benchmarks/contract_rate.py PATH [N]

Draws N cases (generate phase only, seed 0) from the strategy the path's
fuzz target uses (``Target.strategy`` without its filter) and counts
``supports(case)`` reasons: what the filter would redraw, i.e. generation
spent on cases that never run.
"""

from __future__ import annotations

import sys
from collections import Counter

from hypothesis import HealthCheck, Phase, given, seed, settings

from harness.engine import target as T
from harness.paths import close_paths, resolve


def main() -> None:
    name, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 600
    path = resolve(name)[0]
    reasons: Counter[str] = Counter()
    strategy = T.Target([path]).strategy().wrapped_strategy.filtered_strategy  # before its filter

    @settings(max_examples=n, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck),
              deadline=None)
    @seed(0)
    @given(strategy)
    def draw(case) -> None:
        reasons[path.supports(case) or "in contract"] += 1

    try:
        draw()
    finally:
        close_paths([path])
    total = sum(reasons.values())
    out = total - reasons["in contract"]
    print(f"{name}: {out} of {total} generated cases outside its contract ({100 * out / total:.1f}%)")
    for why, k in reasons.most_common(8):
        print(f"  {k:5d}  {why[:140]}")


if __name__ == "__main__":
    main()
