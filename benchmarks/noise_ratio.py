"""How far do right paths stray, against eager float32's own noise?

    PYTHONPATH=. python benchmarks/noise_ratio.py PATH [EXAMPLES] [SEED]

Draws PATH's tolerance-mode cases (its target's strategy, seeded), runs
the path on each, and for every parameter grad after every backward puts
the path's largest difference from the float64 oracle over the larger of
eager float32's two measured errors there (plain and on jittered inputs,
``Tolerance``'s noise; scaled to float64's step for a float64 case). The
tolerance allows ``NOISE_K`` (64) of that, or a floor of 128 steps of
the tensor (or of its largest neighbour): a path that computes in another
order must stay well under 64 for the cap to be safe. Prints the count
of grads compared, the 50th, 99th percentile and largest ratio, and the
grads whose difference is over ``NOISE_K`` times the noise but under the
floor (the floor is what keeps them agreeing). Also the differences in
steps of the case's dtype at each tensor's largest element: what a floor
of steps of the tensor itself would have to allow.
"""

from __future__ import annotations

import sys

from hypothesis import HealthCheck, Phase, given, seed, settings

from harness.compare.values import EPS, NOISE_K, SLACK
from harness.engine.check import CaseCheck
from harness.engine.target import Target
from harness.paths import resolve


def main() -> None:
    path = resolve(sys.argv[1])[0]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    ratios: list[float] = []
    steps: list[float] = []  # the difference in steps of the case's dtype at the tensor's largest element
    floored: list[str] = []
    cases = [0]

    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), phases=(Phase.generate,),
              database=None)
    @seed(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    @given(Target([path]).strategy())
    def draw(case) -> None:  # type: ignore[no-untyped-def]
        if path.supports(case) is not None:
            return
        cc = CaseCheck(case)
        if cc.tol.exact or (hasattr(path, "rounding") and path.rounding(case)[0]):
            return
        obs = path.run(case)
        if obs.failure is not None:
            return
        cases[0] += 1
        noise, jitter, scale = cc.tol._noise(), cc.tol._jitter(), cc.tol.noise_scale
        for o, a in zip(cc.oracle.steps, obs.steps):
            for name, e in o.grads.items():
                g = a.grads.get(name)
                at = ("param", name, o.k)
                if e is None or g is None or g.shape != e.shape or not e.numel() or at not in noise:
                    continue
                err = max(noise[at][0], jitter.get(at, (0.0, 0.0))[0]) * scale
                diff = float((g.double() - e.double()).abs().max())
                if float(e.abs().max()) > 0:
                    steps.append(diff / (EPS[case.dtype] * float(e.abs().max())))
                if err > 0:
                    ratios.append(diff / err)
                    own = SLACK * EPS[case.dtype] * float(e.abs().max())
                    if diff > NOISE_K * err and diff <= own:
                        floored.append(f"{name}@{o.k}: diff {diff:.2g}, noise {err:.2g}, own floor {own:.2g}")

    draw()
    r = sorted(ratios)
    at = (lambda q: f"{r[min(int(q * len(r)), len(r) - 1)]:.3g}") if r else (lambda q: "-")
    st = sorted(steps)
    st_at = (lambda q: f"{st[min(int(q * len(st)), len(st) - 1)]:.3g}") if st else (lambda q: "-")
    print(f"{path.name}: {cases[0]} tolerance cases, {len(r)} grads; diff / noise: "
          f"median {at(0.5)}, p99 {at(0.99)}, max {at(1.0)}; diff in steps of the tensor's largest element: "
          f"median {st_at(0.5)}, p99 {st_at(0.99)}, max {st_at(1.0)}; over {NOISE_K}x the noise, under the floor: "
          f"{len(floored)}")
    for line in floored[:10]:
        print("  ", line)


if __name__ == "__main__":
    main()
