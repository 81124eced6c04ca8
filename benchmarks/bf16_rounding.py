"""How many bfloat16 rounding steps per unit of term size a bf16 path needs.

Draws cases for the first path given (the fuzzer's own strategy and seed),
forces DeepSpeed's bf16 knob on, runs each case on every path given, and
reports the largest |actual - oracle| / (2**-8 x term bound) over every
grad and input grad: the slack ``harness.compare.values.LOW_SLACK`` must
stay above it. Cases where ``eager.accumulate`` itself diverges are left
out (the deepspeed paths are judged against it).

    PYTHONPATH=. python benchmarks/bf16_rounding.py 150 deepspeed.zero0.stock,deepspeed.zero2.stock 2
"""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings

from hypothesis import HealthCheck, Phase, given, seed as hseed, settings


def main(n: int, names: str, seed: int) -> None:
    from harness.compare.values import LOW_EPS, LOW_SLACK
    from harness.engine.check import CaseCheck
    from harness.engine.session import plan
    from harness.materialize.tensors import magnitude_bounds
    from harness.paths import Options, close_paths, resolve
    from harness.paths.deepspeed.data import knobs

    paths = resolve(names.split(","), Options(world_size=2))
    cases: list = []
    target = plan(paths[:1], exact=None, seed=seed)[0]

    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck),
              phases=(Phase.generate,))
    @hseed(seed)
    @given(target.strategy())
    def draw(case):
        cases.append(case)

    draw()
    eps, worst, t0 = LOW_EPS["bfloat16"], [], time.time()
    for case in cases:
        case = case.with_data("deepspeed", dataclasses.replace(knobs(case), bf16=True))
        cc = CaseCheck(case)
        if cc._base_diverges("eager.accumulate"):
            continue
        bounds = magnitude_bounds(case)
        peak = float(bounds.pop("__peak__"))
        for p in paths:
            if p.supports(case) is not None:
                continue
            obs = cc.observe(p)
            need = 0.0
            for o, a in zip(cc.oracle.steps, obs.steps):
                pairs = [(e, (a.grads or {}).get(n), bounds.get(n)) for n, e in o.grads.items()]
                pairs += [(e, (a.input_grads or {}).get(n), None) for n, e in o.input_grads.items()]
                for e, g, b in pairs:
                    if e is None or g is None:
                        continue
                    allow = eps * (b if b is not None and b.shape == e.shape else peak) + 1e-30
                    need = max(need, float(((g - e).abs() / allow).max()))
            worst.append((need, p.name, len(case.nodes)))
    close_paths(paths)
    worst.sort(reverse=True)
    print(f"{len(worst)} runs in {time.time() - t0:.0f} s; slack allowed {LOW_SLACK} steps")
    for need, name, nodes in worst[:5]:
        print(f"  {need:.2f} steps  {name}  ({nodes} nodes)")


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
