"""Observations made versus possible, per family (issue 33 item 1), in this
checkout or an older one: the probe of ``harness/engine/probe.py`` (always
this checkout's file) run on every available kind of path of ``--tree``.

    python benchmarks/observations.py [--tree /path/to/older/checkout] [--json out.json]

Counts are over the probed observations (``probes()``). "made" means the
path's Observation shows it; in trees before issue 33, a None versus zeros
grad was recorded but compare called the two equal, so ``--none-compared
no`` counts that row as not made there.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=HERE, help="checkout whose harness is probed (default: this one)")
    ap.add_argument("--none-compared", choices=("yes", "no"), default="yes",
                    help="whether that tree's compare tells a None grad from zeros (no: before issue 33)")
    ap.add_argument("--json", help="write the per-path statuses here")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree))
    spec = importlib.util.spec_from_file_location("gradfuzz_probe", os.path.join(HERE, "harness", "engine", "probe.py"))
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    from harness.paths import families

    table = {}
    for family in families():
        for path in probe.kinds(family.name):
            status = probe.survey(path)
            if args.none_compared == "no" and status.get("None versus zeros") == "made":
                status["None versus zeros"] = "not compared"
            table[path.name] = status
            made = sum(v == "made" for v in status.values())
            blind = sum(v == "blind" for v in status.values())
            print(f"{path.name:40s} made {made}/{len(status)}, declared blind {blind}, "
                  f"silent {len(status) - made - blind}: "
                  + ", ".join(f"{k} ({v[:40]})" for k, v in status.items() if v not in ("made", "blind")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
