"""Machinery coverage and findings, unguided against coverage-guided, at equal examples.

For each path selection and each budget, runs ``gradfuzz fuzz`` (in this
tree, a fresh process per run, ``--db none``, a fresh findings folder) with
``--coverage measure`` (unguided: the plain generator, traced) and
``--coverage guide`` (each example's new machinery lines handed to
Hypothesis's ``target()``), on the same seed and the same ``--examples``,
and prints the lines and arcs of the family's machinery each reached and
the signatures each found, with those only the guided run found. ``off``
(no tracing) may be added to measure the tracer's overhead: it draws the
same cases as ``measure``, so the findings match and only the time differs.

    python benchmarks/coverage_guided.py --paths split,checkpoint,compile.aot_eager --examples 500,5000 \\
        --seed 1 --json coverage_guided.json

Times are wall clock and the CPU of the run's processes (workers included);
on a shared machine only the CPU times compare.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any


def run(tree: str, paths: str, examples: int, seed: int, mode: str, timeout: float) -> dict[str, Any]:
    """One ``gradfuzz fuzz`` run; its coverage, signatures and times."""
    with tempfile.TemporaryDirectory(prefix="gradfuzz-cov-") as d:
        out = os.path.join(d, "r.json")
        cmd = [sys.executable, "-m", "harness", "fuzz", "--paths", paths, "--examples", str(examples),
               "--seed", str(seed), "--db", "none", "--save", os.path.join(d, "found"), "--json", out,
               "--progress", "none"]
        if mode != "off":
            cmd += ["--coverage", mode]
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "OMP_NUM_THREADS": "1"}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=env, cwd=os.path.abspath(tree), capture_output=True, text=True,
                                  timeout=timeout, check=False)
            rc, tail = proc.returncode, proc.stdout[-1500:] + proc.stderr[-1500:]
        except subprocess.TimeoutExpired:
            rc, tail = 124, "timed out"
        wall = time.monotonic() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        row: dict[str, Any] = {"paths": paths, "examples": examples, "seed": seed, "mode": mode, "rc": rc,
                               "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                               "command": " ".join(["gradfuzz", *cmd[3:]]).replace(d, "$TMP")}
        if not os.path.exists(out):
            row["error"] = tail
            return row
        with open(out) as fh:
            result = json.load(fh)
    row["drawn"] = max((t["examples"] for t in result["paths"].values()), default=0)
    row["coverage"] = result.get("coverage") or {}
    row["signatures"] = sorted(result.get("counts", {}))
    row["errors"] = result.get("errors", [])
    return row


def _cov(row: dict[str, Any]) -> str:
    return "; ".join(f"{f} {c['lines']}/{c['of']} lines, {c['arcs']} arcs" for f, c in sorted(row.get("coverage", {}).items())) or "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="split,checkpoint,compile.aot_eager",
                    help="comma-separated selections, each fuzzed on its own (default: %(default)s)")
    ap.add_argument("--examples", default="500", help="comma-separated budgets (examples per path)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--modes", default="measure,guide", help="any of off, measure, guide (default: %(default)s)")
    ap.add_argument("--tree", default=".", help="the checkout to run (default: this one)")
    ap.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per run")
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args()
    rows = []
    for paths in args.paths.split(","):
        for n in (int(x) for x in args.examples.split(",")):
            by_mode = {}
            for mode in args.modes.split(","):
                row = run(args.tree, paths, n, args.seed, mode, args.timeout)
                by_mode[mode] = row
                rows.append(row)
                print(f"{paths:<20} {n:>6} {mode:<8} rc {row['rc']} drawn {row.get('drawn', '-')} "
                      f"cpu {row['cpu_s']}s wall {row['wall_s']}s | {_cov(row)} | "
                      f"{len(row.get('signatures', []))} signature(s)", flush=True)
                if "error" in row:
                    print(f"  run failed: {row['error']}", flush=True)
                _write(args.json, rows)  # after every run: a long benchmark stopped early keeps what it ran
            if "measure" in by_mode and "guide" in by_mode:
                g, u = set(by_mode["guide"].get("signatures", [])), set(by_mode["measure"].get("signatures", []))
                by_mode["guide"]["only_guided"] = sorted(g - u)
                by_mode["measure"]["only_unguided"] = sorted(u - g)
                print(f"  only guided: {sorted(g - u) or 'none'}; only unguided: {sorted(u - g) or 'none'}", flush=True)
            if "off" in by_mode and "measure" in by_mode and by_mode["off"]["cpu_s"]:
                print(f"  tracer overhead (CPU, measure/off): {by_mode['measure']['cpu_s'] / by_mode['off']['cpu_s']:.2f}x",
                      flush=True)
    _write(args.json, rows)
    return 0


def _write(file: str | None, rows: list[dict[str, Any]]) -> None:
    if file:
        with open(file, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
