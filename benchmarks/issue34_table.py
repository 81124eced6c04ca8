"""Issue 34's table: examples/s of its six paths, in two checkouts, side by side.

Usage, from the repository root::

    python benchmarks/issue34_table.py --tree /tmp/before --tree . --rounds 1

For every path and round, each tree in turn runs ``gradfuzz fuzz --paths P
--examples N --seed 0 --db none`` in a fresh process (so a compile flavour's
child start is counted, as a user meets it); the row gives the path's own
seconds from the run's JSON (what its target took, shrinking included) and
the process's wall time, and examples/s against split.fixed's of the same
tree and round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROWS = [("split.fixed", 200), ("eager.accumulate", 200), ("ddp.fixed", 100), ("checkpoint.fixed", 200),
        ("compile.aot_eager", 40), ("compile.inductor", 40)]


def run(tree: str, path: str, examples: int) -> tuple[int, float, float]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "harness", "fuzz", "--paths", path, "--examples", str(examples),
                        "--seed", "0", "--db", "none", "--save", os.path.join(d, "found"), "--json", out,
                        "--progress", "none"], env=env, cwd=d, capture_output=True, check=False)
        wall = time.monotonic() - t0
        data = json.load(open(out))
        p = data["paths"][path]
        return p["examples"], p["seconds"], wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    print("| tree | path | examples | seconds (path) | wall (process) | examples/s | vs split.fixed |")
    print("|---|---|---|---|---|---|---|")
    for r in range(a.rounds):
        base: dict[str, float] = {}
        for path, n in ROWS:
            for tree in a.tree:
                ex, sec, wall = run(tree, path, n)
                rate = ex / sec if sec else float("nan")
                base.setdefault(tree, rate) if path == "split.fixed" else None
                print(f"| {tree} | {path} | {ex} | {sec:.2f} | {wall:.1f} | {rate:.2f} | {rate / base[tree]:.3f} |",
                      flush=True)


if __name__ == "__main__":
    main()
