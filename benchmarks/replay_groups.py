"""Seconds per child of the gate's corpus replay (``replay_on_workers``), and the whole.

    PYTHONPATH=. python benchmarks/replay_groups.py [PATHS] [WORKERS]

Run from the repository root: replays ``cases/`` on every available path (or
the PATHS selection) on WORKERS children (default 2) and prints the wall
time, the number of (case, path) results, and each child's seconds, slowest
first. Its numbers are in docs/benchmarks.md (session 14).
"""

from __future__ import annotations

import sys
import time

from harness.artifacts import corpus
from harness.engine import replay_pool
from harness.paths import Options, resolve, split_available


def main() -> None:
    selection = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "all" else None
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    seconds: dict[str, float] = {}
    run_jobs = replay_pool.run_jobs

    def timed(argvs, n, folder, on_end, on_tick=None, tick=10.0):  # type: ignore[no-untyped-def]
        def end(e):  # type: ignore[no-untyped-def]
            seconds[e.key] = e.seconds
            on_end(e)
        return run_jobs(argvs, n, folder, end, on_tick, tick)

    replay_pool.run_jobs = timed
    options = Options()
    live, _ = split_available(resolve(selection, options))
    entries = [corpus.load(f) for f in corpus.discover(["cases"])]
    t0 = time.monotonic()
    results = replay_pool.replay_on_workers(entries, live, workers, options)
    print(f"{time.monotonic() - t0:.1f} s, {len(results)} (case, path) results, {len(entries)} cases, {len(live)} paths")
    for key, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"{s:7.1f} {key}")


if __name__ == "__main__":
    main()
