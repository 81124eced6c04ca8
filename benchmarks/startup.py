"""Start-up of the CLI against a bare ``import torch`` (issue 34, item 5).

Usage, from the repository root::

    python benchmarks/startup.py --runs 7
    python benchmarks/startup.py --runs 7 --tree /tmp/before --tree .

Each round runs every command once, in turn, in every ``--tree`` (so load
that comes and goes falls on all of them alike); the table gives each
command's median wall time and its ratio to the median of ``python -c
"import torch"``. The CLI is run as ``python -m harness`` from the tree's
root, which is what the ``gradfuzz`` script runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CASE = "cases/split/scale_hook_applied_twice.json"
CHECKPOINT_CASE = "cases/checkpoint/sac_rms_norm_cached_mean_mutated.json"
COMMANDS = {
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    # The floor of any command that runs split or pipeline paths: the machinery
    # under test is torch.distributed.pipelining, whose package imports
    # torch._dynamo (about as long again as torch itself).
    "python -c 'import torch.distributed.pipelining'": [sys.executable, "-c", "import torch.distributed.pipelining"],
    "gradfuzz --help": [sys.executable, "-m", "harness", "--help"],
    "gradfuzz paths": [sys.executable, "-m", "harness", "paths"],
    f"gradfuzz replay {CASE} --paths split.stock": [sys.executable, "-m", "harness", "replay", CASE, "--paths", "split.stock"],
    f"gradfuzz replay {CHECKPOINT_CASE} --paths checkpoint":
        [sys.executable, "-m", "harness", "replay", CHECKPOINT_CASE, "--paths", "checkpoint"],
}


def once(argv: list[str], cwd: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, cwd=cwd)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tree", action="append", help="a checkout to run the CLI in (repeatable; default .)")
    args = ap.parse_args()
    trees = args.tree or ["."]
    rows = [(name, tree) for name in COMMANDS for tree in (trees if name.startswith("gradfuzz") else trees[:1])]
    times: dict[tuple[str, str], list[float]] = {r: [] for r in rows}
    load0 = os.getloadavg()[0]
    for _ in range(args.runs):
        for name, tree in rows:
            times[(name, tree)].append(once(COMMANDS[name], tree))
    base = statistics.median(times[rows[0]])
    print(f"1-minute load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; "
          f"{os.cpu_count()} cores; {args.runs} runs")
    print("| command | tree | median s | min s | x import torch |")
    print("|---|---|---|---|---|")
    for (name, tree), ts in times.items():
        print(f"| `{name}` | {tree if name.startswith('gradfuzz') else ''} | {statistics.median(ts):.2f} | "
              f"{min(ts):.2f} | {statistics.median(ts) / base:.2f} |")

if __name__ == "__main__":
    main()
