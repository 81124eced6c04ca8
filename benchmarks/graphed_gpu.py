#!/usr/bin/env python
"""The graphed path on a real GPU: detection, cleanliness, canary, throughput, compile.

One batched run (device time is scarce): every section writes into
``OUT/results.json`` as it finishes, so a section that fails or runs out of
time loses only itself. Saved findings and their repro scripts go into
``OUT/found.tar.gz``; the log is ``OUT/log.txt``.

    PYTHONPATH=. python benchmarks/graphed_gpu.py --out $OUT [--sections a,b] [--deadline 500]

Sections: env, paths, seedcase, cli, detect, fixed, canary, compile, pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
import warnings

warnings.filterwarnings("ignore", message=".*NumPy.*")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from harness.paths.base import Contract  # noqa: E402
from harness.paths.graphed.paths import paths as graphed_paths  # noqa: E402
from harness.paths import Options  # noqa: E402
from harness.engine.runner import Result, check, fuzz_path  # noqa: E402
from harness.case.spec import Case  # noqa: E402

START = time.monotonic()
RESULTS: dict = {}
ARGS = None


def log(msg: str) -> None:
    line = f"[{time.monotonic() - START:7.1f}s] {msg}"
    print(line, flush=True)
    with open(os.path.join(ARGS.out, "log.txt"), "a") as f:
        f.write(line + "\n")


def save() -> None:
    tmp = os.path.join(ARGS.out, ".results.json")
    with open(tmp, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    os.replace(tmp, os.path.join(ARGS.out, "results.json"))


def left() -> float:
    return ARGS.deadline - (time.monotonic() - START)


def sh(cmd: list[str], timeout: float) -> dict:
    t = time.monotonic()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(timeout, 1))
        return {"cmd": " ".join(cmd), "rc": r.returncode, "seconds": round(time.monotonic() - t, 2),
                "stdout": r.stdout[-6000:], "stderr": r.stderr[-3000:]}
    except subprocess.TimeoutExpired as e:
        return {"cmd": " ".join(cmd), "rc": "timeout", "seconds": round(time.monotonic() - t, 2),
                "stdout": (e.stdout or b"")[-4000:].decode("utf-8", "replace") if isinstance(e.stdout, bytes) else (e.stdout or "")[-4000:]}


class Recording:
    """Wraps a path: per-run wall time, capture and replay timings, schedule features."""

    def __init__(self, path) -> None:
        self.path = path
        self.name, self.contract = path.name, path.contract
        self.runs: list[dict] = []

    def availability(self):
        return self.path.availability()

    def supports(self, case):
        return self.path.supports(case)

    def repro(self, case):
        return self.path.repro(case)

    def run(self, case: Case):
        t = time.perf_counter()
        obs = self.path.run(case)
        s = case.schedule
        self.runs.append({
            "wall_s": time.perf_counter() - t, "build_s": obs.extra.get("build_s"),
            "backwards_s": obs.extra.get("backwards_s", []), "backwards": s.backwards,
            "events": len(s.events), "pressure": any(e.kind in ("alloc", "empty_cache") for e in s.events),
            "hooks": bool(s.param_hooks), "retain_outputs": s.retain_outputs, "exact": case.exact,
            "violations": [v.kind for v in obs.violations], "failure": obs.failure.message if obs.failure else None,
        })
        return obs

    def close(self) -> None:
        self.path.close()

    def summary(self) -> dict:
        runs = [r for r in self.runs if r["build_s"] is not None]
        first = [r["backwards_s"][0] for r in runs if r["backwards_s"]]
        later = [b for r in runs for b in r["backwards_s"][1:]]
        return {
            "runs": len(self.runs),
            "path_wall_s_total": round(sum(r["wall_s"] for r in self.runs), 2),
            "path_runs_per_s": round(len(self.runs) / max(sum(r["wall_s"] for r in self.runs), 1e-9), 2),
            "capture_s_median": _med([r["build_s"] for r in runs]),
            "capture_s_p90": _pct([r["build_s"] for r in runs], 0.9),
            "first_microbatch_s_median": _med(first),
            "replay_microbatch_s_median": _med(later),
            "replay_microbatch_s_p90": _pct(later, 0.9),
            "cases_with_pressure": sum(r["pressure"] for r in self.runs),
            "cases_with_events": sum(r["events"] > 0 for r in self.runs),
            "cases_with_hooks": sum(r["hooks"] for r in self.runs),
            "cases_with_retained_outputs": sum(r["retain_outputs"] for r in self.runs),
            "violations": sorted({v for r in self.runs for v in r["violations"]}),
        }


def _med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 5) if xs else None


def _pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    return round(xs[min(int(q * len(xs)), len(xs) - 1)], 5) if xs else None


def fresh(name: str):
    """A cold worker for one graphed path (``--standin``: its CPU stand-in, to dry-run this script)."""
    if ARGS.standin:
        from tests.standins import isolated
        impl = {"graphed.stock": "tests.standins:aliased", "graphed.fixed": "tests.standins:fixed"}[name]
        return isolated(name, impl, owned_outputs=name == "graphed.fixed")
    return {p.name: p for p in graphed_paths(Options(timeout=60))}[name]


def divs_json(result: Result) -> list[dict]:
    out = []
    for d in result.divergences:
        c = Case.from_json(d.case) if d.case else None
        out.append({"path": d.path, "kind": d.kind, "signature": d.signature, "detail": d.detail, "flaky": d.flaky,
                    "params": len(c.params) if c else None, "backwards": c.schedule.backwards if c else None,
                    "schedule": c.to_json()["schedule"] if c else None})
    return out


def fuzz(path, **kw) -> tuple[Result, float]:
    result = Result()
    t = time.monotonic()
    fuzz_path(path, result=result, save_dir=kw.pop("save_dir", None), progress=lambda s: log(s[:400]), **kw)
    return result, time.monotonic() - t


# --- sections ------------------------------------------------------------------


def s_env():
    p = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = None
    import hypothesis
    RESULTS["env"] = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": p.name if p else None,
                      "sm": f"{p.major}.{p.minor}" if p else None, "triton": tv, "hypothesis": hypothesis.__version__,
                      "python": sys.version.split()[0],
                      "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32}


def s_paths():
    RESULTS["paths"] = sh([sys.executable, "-m", "harness", "paths"], 120)


def s_seedcase():
    RESULTS["seedcase_script"] = sh([sys.executable, "cases/graphed/make_graphed_callables_static_grad_alias.py"], 120)
    RESULTS["seedcase_replay"] = sh([sys.executable, "-m", "harness", "replay", "cases/graphed", "--paths",
                                     "eager,graphed.stock,graphed.fixed", "-v"], 240)


def s_cli():
    found = os.path.join(ARGS.out, "found", "stock")
    r = sh([sys.executable, "-m", "harness", "fuzz", "--paths", "graphed.stock", "--examples", str(ARGS.cli_examples),
            "--seed", "0", "--save", found, "--json", os.path.join(ARGS.out, "found", "cli_stock.json")],
           min(left(), 300))
    RESULTS["cli_fuzz_stock"] = r
    scripts = sorted(f for f in os.listdir(found) if f.endswith(".py")) if os.path.isdir(found) else []
    RESULTS["cli_repro_scripts"] = {f: sh([sys.executable, os.path.join(found, f)], 120) for f in scripts[:6]}


def s_detect():
    rows = []
    for seed in range(ARGS.seeds):
        if left() < 60:
            log("detect: out of time")
            break
        path = Recording(fresh("graphed.stock"))
        try:
            result, secs = fuzz(path, examples=ARGS.detect_examples,
                                deadline=time.monotonic() + min(left() - 30, ARGS.detect_seconds),
                                seed=seed)
        finally:
            path.close()
        t = result.paths[path.name]
        stale = [d for d in result.divergences if "counted 2 times" in d.detail]
        rows.append({"seed": seed, "first_hit_examples": t.first_hit_examples, "first_hit_seconds": t.first_hit_seconds,
                     "examples": t.examples, "run": t.run, "seconds": round(secs, 1), "distinct": len(result.divergences),
                     "stale_2x": [{"detail": d.detail, "params": len(Case.from_json(d.case).params),
                                   "backwards": Case.from_json(d.case).schedule.backwards} for d in stale[:1]],
                     "divergences": divs_json(result), "timing": path.summary()})
        log(f"detect seed {seed}: first hit after {t.first_hit_examples} examples, {t.first_hit_seconds}s")
        RESULTS["detect"] = rows
        save()


def s_fixed():
    path = Recording(fresh("graphed.fixed"))
    try:
        result, secs = fuzz(path, examples=ARGS.fixed_examples,
                            deadline=time.monotonic() + min(ARGS.fixed_seconds, max(left() - 20, 30)), seed=0)
    finally:
        path.close()
    t = result.paths[path.name]
    RESULTS["fixed"] = {"examples": t.examples, "run": t.run, "skipped": t.skipped, "seconds": round(secs, 1),
                        "examples_per_s": round(t.examples / secs, 2), "divergences": divs_json(result),
                        "timing": path.summary()}


def s_canary():
    from harness.case.spec import Event, Input, Node, Param, Schedule, Use
    from tests.standins import weakref_canary

    def _pressure_case(microbatches: int = 4) -> Case:
        events = tuple(e for k in range(microbatches - 1)
                       for e in (Event(k, "free"), Event(k, "empty_cache"), Event(k, "alloc", (4, 6, 12))))
        return Case(params=(Param("w0", (3, 3)),), inputs=(Input("x0", (2, 3), requires_grad=True),),
                    nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))),), outputs=(Use("n0"),),
                    schedule=Schedule(microbatches=microbatches, events=events))

    out = {}
    canary = Recording(weakref_canary())
    fixed = fresh("graphed.fixed")
    try:
        case = _pressure_case()
        out["pinned_case"] = {"canary": [d.detail for d in check(case, canary)], "fixed": [d.detail for d in check(case, fixed)]}
        for label, lifetime in (("with_lifetime_schedules", True), ("without_lifetime_schedules", False)):
            if left() < 40:
                break
            canary.contract = Contract(retained_grads=False, lifetime_schedules=lifetime)
            result, secs = fuzz(canary, examples=ARGS.canary_examples, seed=0,
                                deadline=time.monotonic() + min(max(left() - 30, 20), ARGS.canary_seconds))
            t = result.paths[canary.name]
            found = divs_json(result)
            again = []
            for d in result.divergences[:4]:
                c = Case.from_json(d.case)
                again.append({"signature": d.signature, "fixed_divergences": [x.detail for x in check(c, fixed)]})
            out[label] = {"first_hit_examples": t.first_hit_examples, "first_hit_seconds": t.first_hit_seconds,
                          "examples": t.examples, "run": t.run, "seconds": round(secs, 1), "divergences": found,
                          "fixed_on_canary_cases": again}
            RESULTS["canary"] = out
            save()
        out["timing"] = canary.summary()
        out["restarts"] = canary.path.restarts
    finally:
        canary.close()
        fixed.close()
    RESULTS["canary"] = out


def s_compile():
    path = Recording(fresh("graphed.compile"))
    found = os.path.join(ARGS.out, "found", "compile")
    out: dict = {"availability": str(path.availability())}
    try:
        if not path.availability().ok:
            RESULTS["compile"] = out
            return
        from harness.artifacts import corpus
        seed_case = corpus.load(os.path.join(ROOT, "cases/graphed/make_graphed_callables_static_grad_alias.json")).case
        out["seed_case"] = [d.detail for d in check(seed_case, path)]
        save()
        budget = min(ARGS.compile_minutes * 60, max(left() - 60 - ARGS.compile_shrink_seconds, 30))
        # Each compile case costs seconds; one finding's shrink must not eat the run.
        from hypothesis.internal.conjecture import engine
        engine.MAX_SHRINKING_SECONDS = ARGS.compile_shrink_seconds
        out["shrink_seconds_cap"] = ARGS.compile_shrink_seconds
        result, secs = fuzz(path, examples=None, deadline=time.monotonic() + budget, seed=ARGS.compile_seed,
                            save_dir=found)
        t = result.paths[path.name]
        out.update({"fuzz_seconds": round(secs, 1), "examples": t.examples, "run": t.run, "skipped": t.skipped,
                    "first_hit_examples": t.first_hit_examples, "divergences": divs_json(result),
                    "saved": result.saved, "timing": path.summary()})
        RESULTS["compile"] = out
        save()
    finally:
        path.close()
    scripts = sorted(f for f in os.listdir(found) if f.endswith(".py")) if os.path.isdir(found) else []
    out["repro_scripts"] = {f: sh([sys.executable, os.path.join(found, f)], min(180, max(left() - 10, 10)))
                            for f in scripts[:5] if left() > 20}
    RESULTS["compile"] = out


def s_compile_cases():
    """Pinned cases for the compile findings: harness check, and standalone scripts with and without held grads."""
    from harness.artifacts import corpus
    from harness.artifacts import repro
    from harness.paths.graphed.paths import compiled
    from harness.case.spec import Input, Node, Param, Schedule, Use

    def mm(x_grad: bool, **sched) -> Case:
        return Case(params=(Param("w0", (3, 3)),), inputs=(Input("x0", (2, 3), requires_grad=x_grad),),
                    nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))),), outputs=(Use("n0"),),
                    schedule=Schedule(**sched), seed=3)

    pinned = {
        "two_steps_two_mb": mm(False, microbatches=2, steps=2),
        "two_steps_two_mb_xgrad": mm(True, microbatches=2, steps=2),
        "two_steps_two_mb_zeros": mm(False, microbatches=2, steps=2, zero_grad="zeros"),
        "one_step_three_mb": mm(False, microbatches=3, steps=1),
        "three_steps_one_mb": mm(False, microbatches=1, steps=3),
    }
    scripts = {"two_steps_two_mb", "three_steps_one_mb"}
    where = os.path.join(ARGS.out, "found", "pinned")
    os.makedirs(where, exist_ok=True)
    out: dict = {}
    path = fresh("graphed.compile")
    try:
        for name, case in pinned.items():
            if left() < 60:
                break
            t = time.monotonic()
            divs = check(case, path)
            out[name] = {"seconds": round(time.monotonic() - t, 1), "divergences": [f"{d.kind}: {d.detail}" for d in divs]}
            corpus.save(where, name, corpus.Entry(case, {"title": name}),
                        repro.script(case, "graphed.compile", compiled().repro(case), title=name))
            log(f"pinned {name}: {out[name]}")
            RESULTS["compile_cases"] = out
            save()
    finally:
        path.close()
    for name in sorted(scripts):
        for flag in ([], ["--no-hold"]):
            if left() < 45:
                break
            out.setdefault(name, {})["script" + "".join(flag)] = sh([sys.executable, os.path.join(where, name + ".py"), *flag], 150)
            RESULTS["compile_cases"] = out
            save()


def s_pytest():
    RESULTS["pytest_gpu"] = sh([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/nocover/test_graphed_gpu.py",
                                "-p", "no:cacheprovider"], max(left() - 10, 30))


SECTIONS = {"env": s_env, "paths": s_paths, "seedcase": s_seedcase, "cli": s_cli, "detect": s_detect,
            "fixed": s_fixed, "canary": s_canary, "compile": s_compile, "pytest": s_pytest,
            "compile_cases": s_compile_cases}


def main() -> int:
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/graphed_gpu"))
    ap.add_argument("--sections", default="env,paths,seedcase,cli,detect,fixed,canary")
    ap.add_argument("--deadline", type=float, default=500.0, help="seconds for the whole script")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--detect-examples", type=int, default=40)
    ap.add_argument("--cli-examples", type=int, default=40)
    ap.add_argument("--fixed-examples", type=int, default=1000)
    ap.add_argument("--canary-examples", type=int, default=300)
    ap.add_argument("--compile-minutes", type=float, default=1.0)
    ap.add_argument("--compile-seed", type=int, default=0)
    ap.add_argument("--compile-shrink-seconds", type=int, default=90)
    ap.add_argument("--detect-seconds", type=float, default=60.0, help="cap per seed")
    ap.add_argument("--fixed-seconds", type=float, default=180.0)
    ap.add_argument("--canary-seconds", type=float, default=60.0, help="cap per schedule family")
    ap.add_argument("--standin", action="store_true", help="CPU stand-ins instead of the graphed paths (a dry run)")
    ARGS = ap.parse_args()
    os.makedirs(ARGS.out, exist_ok=True)
    for name in ARGS.sections.split(","):
        if left() < 15:
            RESULTS.setdefault("skipped_sections", []).append(name)
            continue
        log(f"=== {name} ({left():.0f}s left)")
        t = time.monotonic()
        try:
            SECTIONS[name]()
        except Exception:
            RESULTS.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
            log(f"{name} failed:\n{traceback.format_exc()[-2000:]}")
        RESULTS.setdefault("section_seconds", {})[name] = round(time.monotonic() - t, 1)
        save()
    found = os.path.join(ARGS.out, "found")
    if os.path.isdir(found):
        with tarfile.open(os.path.join(ARGS.out, "found.tar.gz"), "w:gz") as tar:
            tar.add(found, arcname="found")
        subprocess.run(["rm", "-rf", found])
    save()
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
