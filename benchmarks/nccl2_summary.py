"""One table from the fuzz JSON files of ``benchmarks/nccl2.sh`` (issue 31).

Each ``--json`` file of a ``gradfuzz fuzz`` run becomes a row: its name
(the script's step: ``n...`` on NCCL, ``g...`` on gloo), each path's
examples and runs (runs count the shrinker's and confirmation's too),
seconds, examples/s, and its findings by the fuzzing front's ledger
label (``resembles <id>``, ``regression? <id>``, ``range wrong? <id>``,
``not in ledger``), with the examples each signature first needed. A file
that is missing or unreadable (a step killed by its ``timeout`` before it
wrote one) is a row that says so, never a clean one.

    python benchmarks/nccl2_summary.py /tmp/nccl2 > summary.md
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections import Counter

# dtensor-partial-lost-on-transposed-grad: seed 002, the founding DTensor bug (torch < 2.13)
SEED_002 = ("dtensor.stock-collective-5039da4ba7", "dtensor.stock-placement-0a912081ec")


def verdict(label: str | None) -> str:
    if not label or label == "not in ledger":
        return "not in ledger"
    return label.split(" (")[0]


def row(file: str) -> str:
    name = os.path.basename(file)[:-5]
    try:
        d = json.load(open(file))
    except Exception as e:  # noqa: BLE001  (a truncated file is reported, not skipped)
        return f"| {name} | unreadable: {type(e).__name__} | | | | |"
    runs = sum(p.get("run", 0) for p in d["paths"].values())
    secs = d.get("seconds") or 0.0
    examples = sum(p.get("examples", 0) for p in d["paths"].values())
    per_path = ", ".join(f"{k} {v.get('examples', 0)}/{v.get('run', 0)}" for k, v in sorted(d["paths"].items()))
    labels: Counter[str] = Counter()
    seed002 = []
    for sig, f in d.get("findings", {}).items():
        labels[verdict(f.get("ledger"))] += 1
        if sig in SEED_002:
            seed002.append(f"{sig} after {f.get('examples')} examples ({f.get('seconds')} s)")
    found = "; ".join(f"{n} {v}" for v, n in sorted(labels.items())) or "none"
    if seed002:
        found += "; seed 002: " + ", ".join(seed002)
    unavailable = "; ".join(f"{k}: {v[:120]}" for k, v in d.get("unavailable", {}).items())
    stop = " (interrupted)" if d.get("interrupted") else ""
    return (f"| {name} | {per_path}{stop} | {examples} / {runs} | {secs:.1f} | {examples / secs if secs else 0:.1f} "
            f"| {found} |"
            + (f" unavailable: {unavailable} |" if unavailable else ""))


def main() -> int:
    folder = sys.argv[1] if len(sys.argv) > 1 else "/tmp/nccl2"
    files = sorted(glob.glob(os.path.join(folder, "*.json")))
    print("| step | examples/runs per path | examples / runs | seconds | examples/s | findings by ledger label "
          "(distinct signatures) |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for f in files:
        if os.path.basename(f).startswith(("cmp-", "gate")):
            continue  # the NCCL-against-gloo runs and the gate have reports of their own
        print(row(f))
    return 0


if __name__ == "__main__":
    sys.exit(main())
