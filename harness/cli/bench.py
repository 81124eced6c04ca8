"""``gradfuzz bench``: where an example's time goes, and how fast canaries fall.

One run measures, per family of paths (``split`` = oracle + stock + fixed):

- a real fuzz target run (rounds, shrinking, saving), after a warm-up that
  learns the signatures already there (steady state: what a long session
  sees); its CPU time per example is the *total*;
- on exactly the cases that run drew: the *floor* (bare float32 forward
  and ``autograd.grad`` of the built module, no harness), the *oracle*,
  and *each path* (measured inside the run);
- *generation*: a generate-only Hypothesis run of the same strategy;
- *harness overhead*: total - generation - oracle - paths (tolerances,
  compare, bookkeeping, Hypothesis's engine beyond drawing).

Times are CPU seconds of this process (``time.process_time``), so other
load on the machine does not inflate them; examples/s on the wall clock
are shown beside them. Then time to detection of every canary from a cold
start (fresh path, no database, no corpus) over ``--canary-seeds`` seeds,
and optionally ``-n 1`` against ``-n 2`` (``--scaling SECONDS``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

TARGETS = {  # the targets, checked in the table
    "split_examples_per_s": 200.0,
    "overhead_share": 0.25,
    "generation_share": 0.5,
    "scaling_n2_over_n1": 1.7,
    "canary_median_s": 2.0,
}


def add_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="measure floor, generation, oracle, paths, overhead and canary detection")
    b.add_argument("--paths", help="families or paths to measure (default: every available one)")
    b.add_argument("--examples", type=int, default=400, help="measured examples per family (default 400)")
    b.add_argument("--warmup", type=int, default=200, help="warm-up examples per family (default 200)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--mode", choices=("both", "exact", "tolerance"), default="both")
    b.add_argument("--canary-seeds", type=int, default=10, help="seeds per canary (default 10)")
    b.add_argument("--canaries", help="comma-separated canary names (default: every one whose base is available)")
    b.add_argument("--canary-budget", type=int, default=1000, help="examples before a canary counts as missed")
    b.add_argument("--scaling", type=float, default=0.0, metavar="SECONDS",
                   help="also run gradfuzz fuzz -n 1 and -n 2 for this long each and compare (default: skip)")
    b.add_argument("--scaling-paths", default="split", help="paths for the scaling runs (default split)")
    b.add_argument("--json", metavar="FILE", help="write every number as JSON")
    b.set_defaults(func=cmd_bench)


def _cpu() -> float:
    return time.process_time()


def _families(paths: list[Any]) -> dict[str, list[Any]]:
    fam: dict[str, list[Any]] = {}
    for p in paths:
        fam.setdefault(p.name.split(".")[0], []).append(p)
    return fam


def floor_time(cases: list[Any]) -> float:
    """CPU seconds for a bare float32 forward + autograd.grad per backward of each case."""
    import torch

    from harness.materialize.tensors import Built

    total = 0.0
    for case in cases:
        b = Built(case)
        params = {n: t.float().requires_grad_(p.requires_grad) for (n, t), p in zip(b.params().items(), case.params)}
        per_k = []
        for k in range(case.schedule.backwards):
            per_k.append(({x.name: b.inputs(k)[x.name].float().requires_grad_(x.requires_grad) for x in case.inputs},
                          [c.float() for c in b.cotangents(k)]))
        t0 = _cpu()
        for inputs, cots in per_k:
            outs = b.forward({**params, **inputs})
            live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
            wrt = [t for t in list(params.values()) + list(inputs.values()) if t.requires_grad]
            if live and wrt:
                torch.autograd.grad([o for o, _ in live], wrt, [c for _, c in live], allow_unused=True)
        total += _cpu() - t0
    return total


def generation_time(target: Any, n: int, seed: int) -> tuple[float, int]:
    """CPU seconds for a generate-only Hypothesis run of the target's strategy."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, seed as hseed, settings

    drawn = [0]

    @settings(max_examples=n, database=None, deadline=None, verbosity=Verbosity.quiet,
              suppress_health_check=list(HealthCheck), phases=(Phase.generate,))
    @hseed(seed)
    @given(target.strategy())
    def draw_only(case: Any) -> None:
        drawn[0] += 1

    t0 = _cpu()
    draw_only()
    return _cpu() - t0, drawn[0]


def bench_family(name: str, paths: list[Any], *, examples: int, warmup: int, seed: int, exact: bool | None) -> dict[str, Any]:
    from harness.engine.runner import Result
    from harness.engine.target import Target, TargetRun

    target = Target(paths, exact=exact, seed=seed)
    warm = TargetRun(target, Result(), examples=warmup)
    warm.run()
    known = set(warm.known)
    measured = Target(paths, exact=exact, seed=seed + 1)
    drawn: list[Any] = []
    run = TargetRun(measured, Result(), examples=examples, record=drawn)
    run.known = set(known)
    w0, c0 = time.perf_counter(), _cpu()
    run.run()
    wall, cpu = time.perf_counter() - w0, _cpu() - c0
    n = max(run.drawn, 1)
    prof = run.profile
    gen_cpu, gen_n = generation_time(measured, n, seed + 1)
    gen = gen_cpu / max(gen_n, 1) * n  # per drawn example, scaled to this run's count
    floor = floor_time(drawn)
    path_total = sum(prof.paths.values())
    overhead = cpu - gen - prof.oracle - path_total
    ms = lambda s: 1000.0 * s / n  # noqa: E731
    rows = [
        {"phase": "floor (bare fwd + autograd.grad, float32)", "ms": ms(floor), "share": None, "note": "not part of the total"},
        {"phase": "generation (Hypothesis, generate-only)", "ms": ms(gen), "share": gen / cpu},
        {"phase": "oracle (eager, float64)", "ms": ms(prof.oracle), "share": prof.oracle / cpu},
    ]
    for p in paths:
        runs = prof.path_runs.get(p.name, 0)
        t = prof.paths.get(p.name, 0.0)
        rows.append({"phase": p.name, "ms": ms(t), "share": t / cpu,
                     "note": f"{1000 * t / max(runs, 1):.2f} ms/run, {runs} run(s) ({100 * runs / max(prof.cases, 1):.0f}% in contract)"})
    rows.append({"phase": "harness overhead (everything else)", "ms": ms(overhead), "share": overhead / cpu,
                 "note": (f"tolerances {ms(prof.tolerance):.2f}, compare {ms(prof.compare):.2f}, "
                          f"Hypothesis outside the body beyond generation {ms(cpu - prof.body - gen):.2f}, "
                          f"rest of the body {ms(prof.body - prof.oracle - path_total - prof.tolerance - prof.compare):.2f} ms")})
    rows.append({"phase": "total", "ms": ms(cpu), "share": 1.0,
                 "note": f"{n / cpu:.0f} examples/s CPU, {n / wall:.0f}/s wall"})
    return {
        "family": name, "paths": [p.name for p in paths], "examples": run.drawn, "calls": prof.cases,
        "known_from_warmup": sorted(known), "new_in_measured": [f.divergences[0].signature for f in run.findings],
        "cpu_s": cpu, "wall_s": wall, "examples_per_s_cpu": n / cpu, "examples_per_s_wall": n / wall,
        "generation_share": gen / cpu, "overhead_share": overhead / cpu, "rows": rows,
    }


def bench_canaries(names: list[str] | None, seeds: int, budget: int, exact: bool | None) -> list[dict[str, Any]]:
    from harness.canaries import all_canaries, resolve_base
    from harness.engine.runner import Result, close_paths
    from harness.engine.target import Target, TargetRun

    out = []
    for c in all_canaries():
        if names and c.name not in names:
            continue
        base, skipped = resolve_base(c)
        row: dict[str, Any] = {"canary": c.name, "base": base.name if base else None}
        if skipped:
            row["skipped"] = skipped
            out.append(row)
            continue
        hits = []
        for s in range(seeds):
            path = c.make()
            t = Target([path], exact=exact, seed=s, relative_to={path.name: base} if base is not None else {})
            run = TargetRun(t, Result(), examples=budget, detect_only=True)
            run.run()
            tally = run.tallies[path.name]
            hits.append((tally.first_hit_examples, tally.first_hit_seconds))
            close_paths([path])
        if base is not None:
            close_paths([base])
        found = [h for h in hits if h[0] is not None]
        row.update(seeds=seeds, caught=len(found), budget=budget)
        if found:
            ex = [h[0] for h in found]
            sec = [h[1] for h in found]
            row.update(median_examples=statistics.median(ex), worst_examples=max(ex),
                       median_s=statistics.median(sec), worst_s=max(sec))
        out.append(row)
    return out


def cold_start_seconds() -> float:
    """Process start to ready-to-fuzz: interpreter, torch, hypothesis, the registry."""
    code = ("import time, warnings; warnings.filterwarnings('ignore'); t=time.time(); "
            "from harness.paths import resolve; from harness.engine.target import Target; resolve('split'); "
            "print(time.time()-t)")
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return time.time() - t0 if r.returncode == 0 else float("nan")


def bench_scaling(seconds: float, paths: str, seed: int) -> dict[str, Any]:
    """gradfuzz fuzz -n 1 against -n 2 on the same paths, one after the other."""
    out: dict[str, Any] = {"seconds": seconds, "paths": paths}
    with tempfile.TemporaryDirectory(prefix="gradfuzz-bench-") as tmp:
        for n in (1, 2):
            report = os.path.join(tmp, f"n{n}.json")
            cmd = [sys.executable, "-m", "harness", "fuzz", "-n", str(n), "--paths", paths, "--minutes",
                   str(seconds / 60), "--seed", str(seed), "--db", "none", "--save", os.path.join(tmp, f"found{n}"),
                   "--progress", "none", "--json", report]
            t0 = time.perf_counter()
            subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 4 + 120)
            wall = time.perf_counter() - t0
            try:
                data = json.load(open(report))
            except (OSError, ValueError):
                out[f"n{n}"] = {"error": "no report"}
                continue
            # Every path of the target sees every case: count cases once (the first path's examples).
            first = next(iter(data["paths"].values()), {"examples": 0, "seconds": 0})
            cases = first["examples"]
            out[f"n{n}"] = {"cases": cases, "fuzz_seconds": first["seconds"], "wall_s": wall,
                            "cases_per_s": cases / max(first["seconds"], 1e-9), "cases_per_s_wall": cases / wall,
                            "worker_cpu_s": data.get("cpu_s"), "load_after": _load(),
                            "cases_per_cpu_s": cases / data["cpu_s"] if data.get("cpu_s") else None}
    if "cases" in out.get("n1", {}) and "cases" in out.get("n2", {}):
        out["ratio"] = out["n2"]["cases"] / max(out["n1"]["cases"], 1)
        c1, c2 = out["n1"].get("cases_per_cpu_s"), out["n2"].get("cases_per_cpu_s")
        if c1 and c2:
            # What -n 2 would give on two free cores: twice the per-core rate it kept.
            out["per_core_efficiency"] = c2 / c1
    return out


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def table(data: dict[str, Any]) -> str:
    lines = [f"gradfuzz bench: torch {data['torch']}, {data['cpus']} CPU(s), load average {data['load_before']} "
             f"(after: {data['load_after']}), seed {data['seed']}; times are CPU ms per example"]
    for fam in data["families"]:
        lines.append("")
        lines.append(f"{fam['family']} ({' + '.join(fam['paths'])}): {fam['examples']} examples, "
                     f"{len(fam['known_from_warmup'])} signature(s) known from the warm-up, "
                     f"{len(fam['new_in_measured'])} new")
        lines.append(f"  {'phase':<44} {'ms/ex':>8} {'share':>7}  note")
        for r in fam["rows"]:
            share = f"{100 * r['share']:.0f}%" if r.get("share") is not None else ""
            lines.append(f"  {r['phase']:<44} {r['ms']:>8.3f} {share:>7}  {r.get('note', '')}")
    if data.get("canaries"):
        lines.append("")
        lines.append(f"canaries: time to detection from a cold start (fresh path, no database), "
                     f"{max((c.get('seeds', 0) for c in data['canaries']), default=0)} seeds")
        lines.append(f"  {'canary':<34} {'caught':>7} {'median ex':>10} {'worst ex':>9} {'median s':>9} {'worst s':>8}")
        for c in data["canaries"]:
            if "skipped" in c:
                lines.append(f"  {c['canary']:<34} skipped: {c['skipped']}")
            elif "median_s" in c:
                lines.append(f"  {c['canary']:<34} {c['caught']:>3}/{c['seeds']:<3} {c['median_examples']:>10} "
                             f"{c['worst_examples']:>9} {c['median_s']:>9.3f} {c['worst_s']:>8.3f}")
            else:
                lines.append(f"  {c['canary']:<34} {c['caught']:>3}/{c['seeds']:<3} never caught within {c['budget']} examples")
        lines.append(f"  process cold start (python + torch + gradfuzz, before the first example): {data['cold_start_s']:.2f}s")
    sc = data.get("scaling")
    if sc:
        lines.append("")
        lines.append(f"scaling: gradfuzz fuzz --paths {sc['paths']} for {sc['seconds']:.0f}s each")
        for n in ("n1", "n2"):
            r = sc.get(n, {})
            if "cases" in r:
                per_cpu = f", {r['cases_per_cpu_s']:.0f} per worker CPU second" if r.get("cases_per_cpu_s") else ""
                lines.append(f"  -{n[0]} {n[1]}: {r['cases']} cases, {r['cases_per_s']:.0f}/s while fuzzing, "
                             f"{r['cases_per_s_wall']:.0f}/s including start-up ({r['wall_s']:.1f}s wall){per_cpu}; "
                             f"load after {r.get('load_after', '?')}")
            else:
                lines.append(f"  -{n[0]} {n[1]}: {r.get('error', 'not run')}")
        if "ratio" in sc:
            lines.append(f"  -n 2 / -n 1 = {sc['ratio']:.2f}x (cases in the same wall time)")
        if "per_core_efficiency" in sc:
            lines.append(f"  per-core efficiency of -n 2 against -n 1: {100 * sc['per_core_efficiency']:.0f}% "
                         f"(cases per worker CPU second; with two free cores -n 2 gives about "
                         f"{2 * sc['per_core_efficiency']:.2f}x)")
    for fam, err in data.get("errors", {}).items():
        lines.append(f"\n{fam}: not measured: {err}")
    lines.append("")
    lines.append("targets:")
    for t in data["targets"]:
        lines.append(f"  {'met   ' if t['met'] else 'MISSED'} {t['what']}: {t['value']} (target {t['target']})")
    return "\n".join(lines)


def _targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for fam in data["families"]:
        if fam["family"] == "split":
            v = fam["examples_per_s_cpu"]
            out.append({"what": "split (oracle + stock + fixed) examples/s on one core", "value": f"{v:.0f}",
                        "target": ">= 200", "met": v >= TARGETS["split_examples_per_s"]})
        out.append({"what": f"{fam['family']}: harness overhead share", "value": f"{100 * fam['overhead_share']:.0f}%",
                    "target": "<= 25%", "met": fam["overhead_share"] <= TARGETS["overhead_share"]})
        out.append({"what": f"{fam['family']}: generation share", "value": f"{100 * fam['generation_share']:.0f}%",
                    "target": "<= 50%", "met": fam["generation_share"] <= TARGETS["generation_share"]})
    for c in data.get("canaries", []):
        if "skipped" in c:
            continue
        v = c.get("median_s")
        out.append({"what": f"canary {c['canary']} median time to detection",
                    "value": "never" if v is None else f"{v:.3f}s", "target": "<= 2s",
                    "met": v is not None and v <= TARGETS["canary_median_s"] and c["caught"] == c["seeds"]})
    sc = data.get("scaling")
    if sc and "ratio" in sc:
        out.append({"what": "-n 2 / -n 1 cases", "value": f"{sc['ratio']:.2f}x", "target": ">= 1.7x",
                    "met": sc["ratio"] >= TARGETS["scaling_n2_over_n1"]})
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from harness.paths import resolve
    from harness.engine.runner import close_paths
    from harness.engine.session import _single_thread

    _single_thread()
    from harness.generate import MODES

    exact = MODES[args.mode]
    data: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                            "load_before": _load(), "seed": args.seed, "examples": args.examples, "families": []}
    paths = resolve(args.paths)
    live = [p for p in paths if p.availability().ok]
    data["unavailable"] = {p.name: p.availability().reason for p in paths if p not in live}
    try:
        for fam, ps in _families(live).items():
            print(f"gradfuzz bench: {fam} ...", file=sys.stderr, flush=True)
            try:
                data["families"].append(bench_family(fam, ps, examples=args.examples, warmup=args.warmup,
                                                     seed=args.seed, exact=exact))
            except Exception as e:  # a path that cannot run here is reported, the rest is measured
                data.setdefault("errors", {})[fam] = f"{type(e).__name__}: {e}"
    finally:
        close_paths(live)
    if args.canary_seeds > 0:
        print("gradfuzz bench: canaries ...", file=sys.stderr, flush=True)
        names = [n for n in (args.canaries or "").split(",") if n] or None
        data["canaries"] = bench_canaries(names, args.canary_seeds, args.canary_budget, exact)
        data["cold_start_s"] = cold_start_seconds()
    if args.scaling > 0:
        print("gradfuzz bench: -n 1 against -n 2 ...", file=sys.stderr, flush=True)
        data["scaling"] = bench_scaling(args.scaling, args.scaling_paths, args.seed)
    data["load_after"] = _load()
    data["targets"] = _targets(data)
    print(table(data))
    if args.json:
        from harness.artifacts.corpus import atomic_write

        atomic_write(args.json, json.dumps(data, indent=1, default=str) + "\n")
    return 0
