"""The same cases on two process-group backends: NCCL against gloo (issue 31).

Three steps, each a subcommand, so a device script can run the two backends
side by side and compare afterwards:

``draw``: a fixed-seed sample of the cases a family's fuzzing draws, saved as
corpus files (no ``meta.expect``: every divergence of theirs counts as
``new`` in a replay, which is fine for a comparison). The draw is the
fuzzer's own: the target ``harness.engine.session.plan`` makes for the
selection, its strategy (contract filter included) and its Hypothesis seed
for round 0; nothing is checked while drawing.

``run``: the replay that ``gradfuzz replay`` does (``harness.engine.runner.replay``,
the function behind it) on one backend, recording every run of a case on a
path: skipped (and why), or the divergences' signatures, kinds and details.

``compare``: two ``run`` files -> one table per family: cases compared (runs
of a case on a path that both backends ran), runs where both agree with the
oracle, runs that diverge on both with the same signatures, and every
difference, listed.

    PYTHONPATH=. python benchmarks/nccl_vs_gloo.py draw --paths dtensor --cases 20 --seed 0 --out sample/dtensor
    PYTHONPATH=. python benchmarks/nccl_vs_gloo.py run --backend gloo --paths dtensor --json gloo.json cases/dtensor sample/dtensor
    PYTHONPATH=. python benchmarks/nccl_vs_gloo.py compare gloo.json nccl.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from typing import Any


def draw(paths: str, n: int, seed: int, out: str, backend: str | None, world_size: int) -> int:
    from hypothesis import HealthCheck, Phase, Verbosity, given, seed as hseed, settings

    from harness.artifacts.corpus import CORPUS_VERSION
    from harness.engine.session import plan
    from harness.engine.target import SHARD_STRIDE
    from harness.paths import Options, close_paths, resolve

    selected = resolve(paths, Options(backend=backend, world_size=world_size))
    got: list[Any] = []
    try:
        targets = plan(selected, exact=None, seed=seed)
        per = max(1, -(-n // len(targets)))  # a selection may hold several case distributions
        for target in targets:
            mine: list[Any] = []

            @settings(max_examples=per, database=None, deadline=None, verbosity=Verbosity.quiet,
                      suppress_health_check=list(HealthCheck), phases=(Phase.generate,))
            @hseed(target.seed * 100_003 + target.shard * SHARD_STRIDE)
            @given(target.strategy())
            def one(case: Any) -> None:
                mine.append(case)

            one()
            got += mine[:per]
    finally:
        close_paths(selected)
    os.makedirs(out, exist_ok=True)
    tag = "+".join(sorted({p.split(".")[0] for p in paths.split(",")}))
    for i, case in enumerate(got[:n]):
        entry = {"gradfuzz_corpus": CORPUS_VERSION, "case": case.to_json(),
                 "meta": {"source": f"benchmarks/nccl_vs_gloo.py draw --paths {paths} --cases {n} --seed {seed}",
                          "title": f"{paths} draw {i} of seed {seed}"}}
        with open(os.path.join(out, f"{tag}-s{seed}-{i:03d}.json"), "w") as f:
            json.dump(entry, f, indent=1)
    print(f"{paths}: {min(n, len(got))} case(s) drawn, seed {seed}, into {out}")
    return 0


def run(targets: list[str], paths: str, backend: str, world_size: int, timeout: float, out: str) -> int:
    import torch

    from harness.artifacts import corpus
    from harness.engine.runner import replay
    from harness.paths import Options, resolve

    files = corpus.discover(targets)
    selected = resolve(paths, Options(backend=backend, world_size=world_size, timeout=timeout))
    runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def each(r: Any) -> None:
        runs.append({"file": r.entry.file, "path": r.path.name, "skipped": r.skipped,
                     "expected": bool(r.divergences) and r.entry.expected_on(r.path.name, torch.__version__),
                     "divergences": [{"signature": d.signature, "kind": d.kind, "detail": d.detail[:600]}
                                     for d in r.divergences]})

    result = replay(files, selected, each=each)
    doc = {"backend": backend, "world_size": world_size, "torch": torch.__version__, "paths": paths,
           "files": len(files), "seconds": round(time.perf_counter() - t0, 1), "runs": runs,
           "unavailable": result.unavailable}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    ran = sum(1 for r in runs if r["skipped"] is None)
    div = sum(1 for r in runs if r["divergences"])
    print(f"{backend}: {len(files)} file(s), {len(runs)} run(s) of a case on a path, {ran} ran, {div} diverged, "
          f"{len(result.unavailable)} path(s) unavailable, {doc['seconds']} s")
    for p, why in result.unavailable.items():
        print(f"  unavailable {p}: {why}")
    return 0


def _family(path: str) -> str:
    return path.split(".")[0]


def _key(run: dict[str, Any]) -> tuple[str, str]:
    return os.path.normpath(run["file"]), run["path"]


def compare(a_file: str, b_file: str, markdown: str | None) -> int:
    a, b = (json.load(open(f)) for f in (a_file, b_file))
    ra = {_key(r): r for r in a["runs"]}
    rb = {_key(r): r for r in b["runs"]}
    fams: dict[str, dict[str, Any]] = defaultdict(lambda: {"compared": 0, "clean": 0, "same": 0, "skipped": 0,
                                                           "one_side": 0, "differ": []})
    for key in sorted(set(ra) | set(rb)):
        fam = fams[_family(key[1])]
        x, y = ra.get(key), rb.get(key)
        if x is None or y is None:
            fam["one_side"] += 1
            continue
        if x["skipped"] is not None or y["skipped"] is not None:
            if (x["skipped"] is None) != (y["skipped"] is None):
                fam["differ"].append((key, f"contract: {a['backend']} {x['skipped'] or 'ran'}; "
                                           f"{b['backend']} {y['skipped'] or 'ran'}"))
            else:
                fam["skipped"] += 1
            continue
        fam["compared"] += 1
        sa = sorted({d["signature"] for d in x["divergences"]})
        sb = sorted({d["signature"] for d in y["divergences"]})
        if sa == sb:
            fam["clean" if not sa else "same"] += 1
            continue
        first = lambda r: r["divergences"][0]["detail"][:300] if r["divergences"] else "agrees"  # noqa: E731
        fam["differ"].append((key, f"{a['backend']}: {sa or 'agrees'} ({first(x)}); "
                                   f"{b['backend']}: {sb or 'agrees'} ({first(y)})"))
    lines = [f"{a['backend']} ({a['torch']}, {a['seconds']} s) against {b['backend']} ({b['torch']}, {b['seconds']} s), "
             f"world size {a['world_size']}", "",
             "| family | cases compared (runs of a case on a path) | both agree with the oracle | same divergences "
             "| verdict differences | skipped on both (contract) | on one side only |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, f in sorted(fams.items()):
        lines.append(f"| {name} | {f['compared']} | {f['clean']} | {f['same']} | {len(f['differ'])} | {f['skipped']} "
                     f"| {f['one_side']} |")
    for name, f in sorted(fams.items()):
        for (file, path), why in f["differ"]:
            lines.append(f"- {path} {file}: {why}")
    for side in (a, b):
        for p, why in side["unavailable"].items():
            lines.append(f"- unavailable on {side['backend']}: {p}: {why}")
    text = "\n".join(lines) + "\n"
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text)
    return 1 if any(f["differ"] for f in fams.values()) else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("draw")
    d.add_argument("--paths", required=True)
    d.add_argument("--cases", type=int, default=20)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", required=True)
    d.add_argument("--backend", default="gloo", help="the group the contract probes run on (default gloo)")
    d.add_argument("--world-size", type=int, default=2)
    r = sub.add_parser("run")
    r.add_argument("targets", nargs="+")
    r.add_argument("--paths", required=True)
    r.add_argument("--backend", required=True, choices=("gloo", "nccl"))
    r.add_argument("--world-size", type=int, default=2)
    r.add_argument("--timeout", type=float, default=10.0)
    r.add_argument("--json", required=True)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--markdown")
    args = ap.parse_args()
    if args.cmd == "draw":
        return draw(args.paths, args.cases, args.seed, args.out, args.backend, args.world_size)
    if args.cmd == "run":
        return run(args.targets, args.paths, args.backend, args.world_size, args.timeout, args.json)
    return compare(args.a, args.b, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
