"""Where graphed.fixed's time goes inside the worker (GPU): the path run in
this process under cProfile over the cases a cold fuzz run draws.

    PYTHONPATH=. python benchmarks/graphed_profile.py [--examples 200] [--top 30]

``gradfuzz bench`` sees only the parent's CPU time (the worker's is spent
while the parent waits on its pipe); this shows the worker's side.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time

from harness.engine.runner import Result, fuzz_path
from harness.paths.graphed.paths import fixed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    path = fixed()
    fuzz_path(path, examples=20, deadline=None, seed=1, result=Result(), save_dir=None)  # CUDA init, first captures
    gc.collect()
    gc.freeze()  # as the isolated worker does after its first case
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    result = Result()
    fuzz_path(path, examples=args.examples, deadline=None, seed=0, result=result, save_dir=None)
    prof.disable()
    wall = time.perf_counter() - t0
    n = result.paths[path.name].examples
    print(f"graphed.fixed in process: {n} examples in {wall:.1f}s = {n / wall:.1f} examples/s "
          f"({len(result.divergences)} divergences)")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
