"""Which OpInfo ops each fuzz target draws, and which its paths take or refuse.

    python benchmarks/op_coverage.py [--paths SEL] [--examples N] [--seed S]

Draws N examples from each target's own strategy (the stream ``gradfuzz
fuzz`` draws, without running anything) and prints, per path: distinct ops
(OpInfo name, variant test name, ``:method`` or ``:inplace``) in cases the
path takes, and the cases with OpInfo nodes it refuses, by reason. Counts
depend on the seed and N only.
"""

from __future__ import annotations

import argparse
from collections import Counter

from hypothesis import HealthCheck, given, seed as hseed, settings

from harness.case import opinfo
from harness.engine.session import plan
from harness.paths import resolve


def survey(target, examples: int, seed: int) -> tuple[set[str], dict[str, set[str]], dict[str, Counter]]:
    drawn: set[str] = set()
    taken: dict[str, set[str]] = {p.name: set() for p in target.paths}
    refused: dict[str, Counter] = {p.name: Counter() for p in target.paths}

    @hseed(seed)
    @settings(max_examples=examples, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(target.strategy())
    def draw(case):
        ops = opinfo.ops_in(case)
        drawn.update(ops)
        for p in target.paths:
            why = p.supports(case)
            if why is None:
                taken[p.name].update(ops)
            elif ops:
                refused[p.name][why.split(":")[0][:80]] += 1

    draw()
    return drawn, taken, refused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default=None)
    ap.add_argument("--examples", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    paths = [p for p in resolve(a.paths) if p.availability().ok]
    print(f"op table: {len(opinfo.keys())} ops, {len(opinfo.draws())} samples ({opinfo.table_path().name})")
    for target in plan(paths, exact=None, seed=a.seed):
        drawn, taken, refused = survey(target, a.examples, a.seed)
        print(f"{target.name}: {len(drawn)} distinct ops drawn in {a.examples} examples")
        for name in sorted(taken):
            why = "; ".join(f"{r} x{n}" for r, n in refused[name].most_common(3))
            print(f"  {name:40s} {len(taken[name]):4d} ops in cases it takes" + (f"; refused: {why}" if why else ""))


if __name__ == "__main__":
    main()
