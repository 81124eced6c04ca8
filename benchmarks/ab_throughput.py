"""Examples/s of one path family in two checkouts, measured side by side.

Runs ``fuzz`` from each tree in turn (A, B, A, B, ...) on the same seed and
budget and prints each run's examples/s and the median ratio B/A: load that
drifts during the run hits both sides alike. Used for issue 20's "the richer
generator must not make the harness more than 25% slower":

    python benchmarks/ab_throughput.py --a .gradfuzz/before --b . --paths split.stock,split.fixed
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def _child_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _rate(tree: str, paths: str, examples: int, seed: int) -> tuple[float, float, float]:
    """Examples/s end to end, while fuzzing, and per CPU second of the whole
    child (start-up included): on a shared machine the last is the steady one."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "OMP_NUM_THREADS": "1"}
        t0, c0 = time.monotonic(), _child_cpu()
        subprocess.run([sys.executable, "-m", "harness", "fuzz", "--paths", paths, "--examples", str(examples),
                        "--seed", str(seed), "--db", "none", "--save", os.path.join(d, "found"), "--json", out,
                        "--progress", "none"], env=env, cwd=os.path.abspath(tree), capture_output=True, check=False)
        wall, cpu = time.monotonic() - t0, _child_cpu() - c0
        with open(out) as f:
            result = json.load(f)
    drawn = max(t["examples"] for t in result["paths"].values())
    fuzzing = max(t["seconds"] for t in result["paths"].values())  # the target's own time: no process start
    return drawn / wall, drawn / fuzzing, drawn / cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="checkout A (e.g. the one before a change)")
    ap.add_argument("--b", default=".", help="checkout B (default: this one)")
    ap.add_argument("--paths", required=True)
    ap.add_argument("--examples", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ratios, steady, by_cpu = [], [], []
    for r in range(args.rounds):
        (a, a_in, a_cpu), (b, b_in, b_cpu) = (_rate(t, args.paths, args.examples, args.seed + r)
                                              for t in (args.a, args.b))
        ratios.append(b / a)
        steady.append(b_in / a_in)
        by_cpu.append(b_cpu / a_cpu)
        print(f"round {r}: A {a:.1f} examples/s, B {b:.1f} examples/s, B/A {b / a:.3f} (end to end); "
              f"while fuzzing: A {a_in:.1f}, B {b_in:.1f}, B/A {b_in / a_in:.3f}; "
              f"per CPU second (start included): A {a_cpu:.1f}, B {b_cpu:.1f}, B/A {b_cpu / a_cpu:.3f}", flush=True)
    print(f"{args.paths}, {args.examples} examples per run: median B/A {statistics.median(ratios):.3f} end to end "
          f"(process start included), {statistics.median(steady):.3f} while fuzzing, "
          f"{statistics.median(by_cpu):.3f} per CPU second, over {args.rounds} rounds; "
          f"1-minute load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
