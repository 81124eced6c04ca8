"""Fuzz compile paths from a cold start and print what the issue asks for.

    python benchmarks/compile_fuzz.py --minutes 3 --paths compile.aot_eager eager.accumulate --json out.json

Per path: examples drawn, cases run, structures compiled, cache hit rate,
graphs compiled, seconds in calls that compiled against calls that did not,
examples/s and compiles/s, peak resident memory of the worker, and each
finding (signature, kind, detail). No example database (cold start); each
path is fuzzed alone, one after the other, so timings do not share the CPU
with each other. Inductor's on-disk cache is pointed at a fresh directory
(``TORCHINDUCTOR_CACHE_DIR``) unless one is set, so compiles are cold too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--paths", nargs="+", required=True)
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None, help="corpus directory for findings")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="gradfuzz-inductor-"))

    from harness.engine.runner import Result, fuzz_path
    from harness.paths import close_paths, resolve

    rows = []
    for name in args.paths:
        path = next(p for p in resolve(name) if p.name == name)
        result = Result()
        start = time.monotonic()
        try:
            fuzz_path(path, examples=None, deadline=start + 60 * args.minutes, seed=args.seed, result=result,
                      save_dir=args.save, progress=lambda s: print(s, file=sys.stderr, flush=True))
        finally:
            close_paths([path])
        wall = time.monotonic() - start
        tally = result.paths[path.name]
        stats = getattr(path, "stats", None)
        row = {
            "path": path.name, "seconds": round(wall, 1), "examples": tally.examples, "run": tally.run,
            "examples_per_s": round(tally.examples / wall, 3),
            "findings": [{"signature": d.signature, "kind": d.kind, "flaky": d.flaky, "detail": d.detail[:300]}
                         for d in result.divergences],
            "first_hit": [tally.first_hit_examples, tally.first_hit_seconds],
        }
        if stats is not None:
            s = stats.to_json()
            row["compile"] = s
            row["compiles_per_s"] = round(s["structures"] / wall, 3)
            row["compile_share"] = round(s["compile_s"] / wall, 3)
            restarts = getattr(path, "restarts", 0)
            row["worker_restarts"] = restarts
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
