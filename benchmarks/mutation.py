"""Mutation score of the fixed references: does fuzzing catch a one-point bug?

Each mutant is one of mutmut's mutations of a fixed reference
(``oracles/split_fixed.py`` and the others); the test a mutant must fail is
"fuzz the paths that use this file for N examples from a cold start". A
mutant survives when every path agrees with the oracle on all N examples.

mutmut supplies the mutation operators only (``create_mutations``): its own
runner runs a test suite per mutant, where the test here is a fuzz session
with its own stopping rule, run many at a time. Each worker owns a copy of
the tree (``--tree``, default this checkout), so the same script measures an
older checkout ("before") beside this one ("after") on the same mutants:

    python benchmarks/mutation.py --file oracles/split_fixed.py --paths split.fixed \\
        --examples 500 --jobs 14 --json out.json [--tree /path/to/older/checkout] [--seeds 0,1,2,3,4]

(``--export``/``--mutants`` carry the mutants to a machine without mutmut.)

Prints the score, the median examples-to-kill and every survivor with its
diff line. Mutants that break the import (the path reports itself
unavailable) are counted apart: no fuzzing is needed to see them.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import difflib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# The test each mutant must fail, run inside the worker's tree copy.
_PROBE = r"""
import json, sys
from harness.paths import resolve
from harness.engine.runner import fuzz_path
from harness.engine.result import Result
names, examples, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = {}
for p in resolve(names):
    a = p.availability()
    if not a.ok:
        out[p.name] = {"unavailable": a.reason[:300]}
        continue
    r = Result()
    fuzz_path(p, examples=examples, deadline=None, seed=seed, result=r, save_dir=None, detect_only=True)
    t = r.paths.get(p.name)
    d = r.divergences[0] if r.divergences else None
    out[p.name] = {"hit": t.first_hit_examples if t else None, "run": t.run if t else 0,
                   "signature": d.signature if d else None, "detail": d.detail[:200] if d else None}
    if d is not None:
        break  # killed: the other paths need not run
print("RESULT " + json.dumps(out))
"""

# The same test held to tolerance-mode cases only (``--tolerance-only``): the
# draws of each path, those in its contract whose case is not exact, each
# checked as the fuzzer checks it. "hit" counts tolerance cases drawn.
_PROBE_TOLERANCE = r"""
import json, sys
from hypothesis import HealthCheck, Phase, given, seed as hseed, settings
from harness.compare.values import Tolerance
from harness.engine.check import check
from harness.engine.target import Target
from harness.paths import resolve
names, examples, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if "--terms-only" in sys.argv[4:]:  # the tolerance before the float32 noise cap: term bounds alone
    Tolerance.with_noise = lambda self, *a, **k: self
out = {}
for p in resolve(names):
    a = p.availability()
    if not a.ok:
        out[p.name] = {"unavailable": a.reason[:300]}
        continue
    seen = {"run": 0, "hit": None, "signature": None, "detail": None, "caught": 0}

    # Every tolerance case is checked, not only up to the first kill: "caught" counts
    # the cases whose check sees the mutant (a one-line mutant changes every case, so
    # the first kill alone says little about how often tolerance mode sees it).
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck),
              phases=(Phase.generate,), database=None)
    @hseed(seed)
    @given(Target([p]).strategy())
    def draw(case):
        if p.supports(case) is not None or Tolerance.for_case(case).exact:
            return
        seen["run"] += 1
        found = check(case, p)
        if found:
            seen["caught"] += 1
            if seen["hit"] is None:
                seen.update(hit=seen["run"], signature=found[0].signature, detail=found[0].detail[:200])

    draw()
    out[p.name] = seen
    if seen["hit"] is not None:
        break
print("RESULT " + json.dumps(out))
"""


def mutants(file: str) -> list[tuple[str, str]]:
    """(one-line diff, full mutated source) for each of mutmut's mutations of ``file``."""
    from mutmut.mutation.file_mutation import create_mutations, deep_replace

    with open(file) as f:
        code = f.read()
    module, found, _, _ = create_mutations(file, code)
    out = []
    for m in found:
        src = deep_replace(module, m.original_node, m.mutated_node).code
        diff = [ln for ln in difflib.unified_diff(code.splitlines(), src.splitlines(), n=0, lineterm="")
                if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
        out.append((" | ".join(d.strip() for d in diff)[:200], src))
    return out


def _copy_tree(tree: str, dest: str) -> None:
    for part in ("harness", "oracles"):
        shutil.copytree(os.path.join(tree, part), os.path.join(dest, part),
                        ignore=shutil.ignore_patterns("__pycache__"))


def _run_one(workdir: str, file: str, src: str, paths: str, examples: int, seed: int, timeout: float,
             probe: str = _PROBE, extra: tuple[str, ...] = ()) -> dict:
    with open(os.path.join(workdir, file), "w") as f:
        f.write(src)
    env = {**os.environ, "PYTHONPATH": workdir, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-c", probe, paths, str(examples), str(seed), *extra], cwd=workdir, env=env,
                           capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": timeout}
    secs = time.monotonic() - t0
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return {"status": "error", "seconds": secs, "stderr": p.stderr[-400:]}
    per_path = json.loads(line[7:])
    hits = [v for v in per_path.values() if v.get("hit") is not None]
    if hits:
        return {"status": "killed", "examples": hits[0]["hit"], "signature": hits[0]["signature"],
                "detail": hits[0]["detail"], "seconds": secs,
                **({"caught": [hits[0]["caught"], hits[0]["run"]]} if "caught" in hits[0] else {})}
    if per_path and all("unavailable" in v for v in per_path.values()):
        return {"status": "unavailable", "reason": next(iter(per_path.values()))["unavailable"], "seconds": secs}
    return {"status": "survived", "seconds": secs}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", required=True, help="the fixed reference to mutate, relative to the tree")
    ap.add_argument("--paths", required=True, help="the paths that use it (comma-separated)")
    ap.add_argument("--examples", type=int, default=500)
    ap.add_argument("--seeds", default="0", help="comma-separated seeds: each mutant is fuzzed from each (cold start)")
    ap.add_argument("--only", default="", help="comma-separated mutant numbers (default: all)")
    ap.add_argument("--export", help="write the mutants as JSON and stop (for a machine without mutmut)")
    ap.add_argument("--mutants", help="read the mutants from an --export file instead of running mutmut")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--tree", default=".", help="checkout whose harness fuzzes the mutants (default: this one)")
    ap.add_argument("--sample", type=int, default=0, help="every k-th mutant only, k chosen to keep about this many")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant (a hang counts as killed)")
    ap.add_argument("--json", help="write every mutant's result here")
    ap.add_argument("--tolerance-only", action="store_true",
                    help="fuzz tolerance-mode cases only (exact mode sees any difference): EXAMPLES draws each")
    ap.add_argument("--terms-only", action="store_true",
                    help="with --tolerance-only: judge by the term bounds alone, without the float32 noise cap "
                         "(the tolerance before it)")
    return ap


def _selected(args: argparse.Namespace, listed: list) -> list:
    """(index, mutant) for the mutants ``--only`` and ``--sample`` keep."""
    todo = list(enumerate(listed))
    if args.only:
        keep = {int(x) for x in args.only.split(",")}
        todo = [t for t in todo if t[0] in keep]
    if args.sample and len(todo) > args.sample:
        step = len(todo) / args.sample
        todo = [todo[int(i * step)] for i in range(args.sample)]
    return todo


def _report(args: argparse.Namespace, seeds: list[int], n: int, results: dict[int, dict], wall: float,
            workers: int) -> None:
    """The score, the examples to kill, every survivor and error; the JSON record."""
    by = {s: [i for i, r in results.items() if r["status"] == s] for s in ("killed", "timeout", "survived", "unavailable", "error")}
    judged = len(by["killed"]) + len(by["timeout"]) + len(by["survived"])
    killed = len(by["killed"]) + len(by["timeout"])
    kills = [results[i]["examples"] for i in by["killed"]]
    print(f"\n{args.file} through {args.paths}, {args.examples} examples per mutant, seeds {args.seeds}, tree {args.tree}:")
    print(f"  mutants {n}: killed {len(by['killed'])}, hung (counted killed) {len(by['timeout'])}, "
          f"survived {len(by['survived'])}, import broken {len(by['unavailable'])}, harness error {len(by['error'])}")
    if judged:
        print(f"  score {killed}/{judged} = {100 * killed / judged:.1f}% (import-broken mutants left out)")
    if kills:
        print(f"  examples to kill: median {statistics.median(kills):g}, max {max(kills)}")
    print(f"  wall {wall:.0f}s on {workers} workers")
    for i in sorted(by["survived"]):
        print(f"  SURVIVED {i}: {results[i]['diff']}")
    for i in sorted(by["error"]):
        print(f"  ERROR {i}: {results[i]['diff']}: {results[i].get('stderr', '')[-200:]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"file": args.file, "paths": args.paths, "examples": args.examples, "seeds": seeds,
                       "tree": args.tree, "mutants": {str(i): r for i, r in sorted(results.items())}}, f, indent=1)


def _baseline_passes(args: argparse.Namespace, seeds: list[int], base: str, probe: str, extra: tuple[str, ...]) -> bool:
    """The unmutated file first, on every seed: a kill of a mutant means nothing
    if the reference itself diverges on that stream."""
    check_dir = os.path.join(base, "baseline")
    _copy_tree(args.tree, check_dir)
    with open(os.path.join(args.tree, args.file)) as f:
        original = f.read()
    for sd in seeds:
        r = _run_one(check_dir, args.file, original, args.paths, args.examples, sd, args.timeout, probe, extra)
        print(f"baseline (unmutated) seed {sd}: {r['status']}" + (f" after {r['examples']} examples: {r.get('detail')}"
                                                                   if r["status"] == "killed" else "")
              + (f": {r.get('stderr', '')[-600:]}" if r["status"] == "error" else ""), flush=True)
        if r["status"] not in ("survived",):
            print(f"the unmutated {args.file} does not pass its own test ({r['status']}): fix that first; "
                  "no mutant can be judged against it")
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.terms_only and not args.tolerance_only:
        ap.error("--terms-only needs --tolerance-only")

    if args.mutants:
        with open(args.mutants) as f:
            listed = [tuple(m) for m in json.load(f)["mutants"]]
    else:
        listed = mutants(args.file)
    if args.export:
        with open(args.export, "w") as f:
            json.dump({"file": args.file, "mutants": listed}, f)
        print(f"{len(listed)} mutants of {args.file} -> {args.export}")
        return 0
    seeds = [int(x) for x in args.seeds.split(",")]
    probe = _PROBE_TOLERANCE if args.tolerance_only else _PROBE
    extra = ("--terms-only",) if args.terms_only else ()
    todo = _selected(args, listed)
    base = tempfile.mkdtemp(prefix="gf-mutation-")
    if not _baseline_passes(args, seeds, base, probe, extra):
        return 1
    workers = []
    for w in range(min(args.jobs, len(todo))):
        d = os.path.join(base, f"w{w}")
        _copy_tree(args.tree, d)
        workers.append(d)
    results: dict[int, dict] = {}
    started = time.monotonic()

    def work(w: int) -> None:
        for n, (i, (diff, src)) in enumerate(todo):
            if n % len(workers) != w:
                continue
            runs = [_run_one(workers[w], args.file, src, args.paths, args.examples, sd, args.timeout, probe, extra)
                    for sd in seeds]
            # A mutant is killed when any seed kills it; its examples-to-kill is the median over the seeds
            # that did (each seed is a cold start: the per-seed numbers are the detection statistics).
            r = next((x for x in runs if x["status"] in ("killed", "timeout")), runs[0])
            r = {**r, "diff": diff, "per_seed": [x.get("examples") if x["status"] == "killed" else x["status"] for x in runs]}
            got = [x["examples"] for x in runs if x["status"] == "killed"]
            if got:
                r["examples"] = statistics.median(got)
            results[i] = r
            caught = [x["caught"] for x in runs if "caught" in x]
            if caught:  # --tolerance-only: the tolerance cases that saw it, over the seeds
                r["caught"] = [sum(c[0] for c in caught), sum(c[1] for c in caught)]
            print(f"[{len(results)}/{len(todo)}] mutant {i}: {r['status']} {r['per_seed']}"
                  + (f" after {r['examples']} examples" if r.get("examples") is not None else "")
                  + (f", seen in {r['caught'][0]} of {r['caught'][1]} tolerance cases" if "caught" in r else "")
                  + f" ({r['seconds']:.0f}s)  {diff[:110]}", flush=True)

    with cf.ThreadPoolExecutor(len(workers)) as pool:
        list(pool.map(work, range(len(workers))))
    shutil.rmtree(base, ignore_errors=True)

    _report(args, seeds, len(todo), results, time.monotonic() - started, len(workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
