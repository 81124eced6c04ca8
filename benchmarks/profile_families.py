"""Where a family's fuzzing time goes, stage by stage (issue 34, item 1).

Usage, from the repository root (``PYTHONPATH=.`` so a copy of the tree
measures its own code)::

    PYTHONPATH=. python benchmarks/profile_families.py
    PYTHONPATH=. python benchmarks/profile_families.py --paths checkpoint.fixed=100 --seed 0

Each path is fuzzed as ``gradfuzz fuzz --paths P --db none`` would fuzz it
(one ``TargetRun``, in this process), with timers wrapped around the
stages. A stage's time is *exclusive*: building inside the oracle counts
as building, a ``gc.collect`` inside a path as ``gc.collect``, so the
CPU columns add up to the process's CPU time of the run. The stages:

- ``gen+hyp``: what no timer covers: drawing the case, Hypothesis's engine
  and the harness's bookkeeping around a case;
- ``supports``: the contract checks (``Path.supports``; the strategy's filter
  calls them for every draw, and the check once more per path);
- ``build``: ``Built`` (parameters, inputs and cotangents from the case);
- ``path``: the path's ``run`` beyond everything else listed;
- ``oracle``: the float64 eager oracle (``oracles.eager.observe``);
- ``tol+cmp``: ``Tolerance.for_case``, ``compare`` and ``CaseCheck.unjudged``
  (with the float32 eager run the tolerance's noise cap may make there);
- ``gc``: ``gc.collect`` (the ``empty_cache`` lifetime event);
- ``ipc``: waiting on other processes: ``WorkerPool.request`` (send, the
  ranks' own work, the replies) and ``IsolatedPath``'s send and receive.

Times are CPU seconds of this process (``time.process_time``), which other
load inflates less than wall time; ``ipc`` is wall time, since the main
process only waits there (the ranks' and workers' CPU is theirs). Compare
rows of one run; the load average is printed with the table.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import time
import warnings
from typing import Any, Callable

warnings.filterwarnings("ignore", message=".*NumPy.*")

DEFAULT = "split.fixed=200,eager.accumulate=200,checkpoint.fixed=100,ddp.fixed=50,compile.aot_eager=20"
STAGES = ("gen+hyp", "supports", "build", "path", "oracle", "tol+cmp", "gc", "ipc")


class Clock:
    """Exclusive CPU and wall time per stage: entering a stage pauses the one it is in."""

    def __init__(self) -> None:
        self.reset()

    @staticmethod
    def _now() -> tuple[float, float]:
        return time.process_time(), time.perf_counter()

    def _switch(self, to: str | None) -> None:
        now = self._now()
        self.spent[self.stack[-1]] += now[0] - self.mark[0]
        self.waited[self.stack[-1]] += now[1] - self.mark[1]
        self.mark = now
        if to is None:
            self.stack.pop()
        else:
            self.stack.append(to)

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            self._switch(stage)
            try:
                return fn(*a, **k)
            finally:
                self._switch(None)

        return timed

    def reset(self) -> None:
        self.spent: dict[str, float] = dict.fromkeys(STAGES, 0.0)  # CPU seconds of this process
        self.waited: dict[str, float] = dict.fromkeys(STAGES, 0.0)  # wall seconds
        self.stack: list[str] = ["gen+hyp"]
        self.mark = self._now()


def _patch_method(cls: type, name: str, stage: str, clock: Clock) -> None:
    raw = cls.__dict__[name]
    if isinstance(raw, classmethod):
        setattr(cls, name, classmethod(clock.wrap(stage, raw.__func__)))
    else:
        setattr(cls, name, clock.wrap(stage, raw))


def instrument(clock: Clock) -> None:
    """Wrap the shared stages once per process (module and class attributes)."""
    import harness.engine.check as check
    from harness.compare.values import Tolerance
    from harness.materialize.tensors import Built
    from harness.workers.isolation import IsolatedPath
    from harness.workers.pool import WorkerPool

    check.observe = clock.wrap("oracle", check.observe)
    check.compare = clock.wrap("tol+cmp", check.compare)
    _patch_method(Tolerance, "for_case", "tol+cmp", clock)
    _patch_method(check.CaseCheck, "unjudged", "tol+cmp", clock)
    _patch_method(Built, "__init__", "build", clock)
    _patch_method(WorkerPool, "request", "ipc", clock)
    _patch_method(IsolatedPath, "_send", "ipc", clock)
    _patch_method(IsolatedPath, "_recv", "ipc", clock)
    gc.collect = clock.wrap("gc", gc.collect)


def instrument_path(path: Any, clock: Clock) -> None:
    """Each path object's own ``supports`` and ``run`` (instance attributes)."""
    path.supports = clock.wrap("supports", path.supports)
    path.run = clock.wrap("path", path.run)


def profile_path(name: str, examples: int, seed: int, clock: Clock) -> dict[str, Any]:
    from harness.engine.result import Result
    from harness.engine.target import Target, TargetRun
    from harness.paths import Options, close_paths, resolve

    paths = resolve(name, Options())
    if not paths or not paths[0].availability().ok:
        return {"path": name, "skipped": "unavailable"}
    for p in paths:
        instrument_path(p, clock)
    run = TargetRun(Target(paths, exact=None, seed=seed), Result(), examples=examples)
    clock.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        run.run()
    finally:
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        spent, waited = dict(clock.spent), dict(clock.waited)
        close_paths(paths)
    return {"path": name, "examples": run.drawn, "wall": wall, "cpu": cpu, "spent": spent, "waited": waited,
            "findings": [f.divergences[0].signature for f in run.findings]}


def row(r: dict[str, Any]) -> str:
    """CPU shares and ms per example; ``ipc`` is wall time (the main process waits)."""
    if "skipped" in r:
        return f"| {r['path']} | {r['skipped']} |" + " |" * (len(STAGES) + 2)
    n, cpu = max(r["examples"], 1), r["cpu"]
    cells = [f"{100 * r['spent'][s] / cpu:.0f}% ({1000 * r['spent'][s] / n:.1f})" for s in STAGES[:-1]]
    cells.append(f"{1000 * r['waited']['ipc'] / n:.1f} wall")
    return (f"| {r['path']} | {r['examples']} | {cpu:.1f} / {r['wall']:.1f} | {n / cpu:.1f} / {n / r['wall']:.1f} | "
            + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", default=DEFAULT, help=f"PATH=EXAMPLES,... (default {DEFAULT})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=20, help="examples per path before its measured run (seed + 1)")
    args = ap.parse_args()
    from harness.engine.session import _single_thread

    _single_thread()  # as gradfuzz fuzz runs: one intra-op thread
    start = os.getloadavg()[0]
    clock = Clock()
    instrument(clock)
    rows = []
    for item in args.paths.split(","):
        name, _, n = item.partition("=")
        if args.warmup:  # first-use costs (imports, lazy torch init) are not the family's steady state
            profile_path(name.strip(), args.warmup, args.seed + 1, clock)
        rows.append(profile_path(name.strip(), int(n or 100), args.seed, clock))
    print(f"1-minute load average {start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; {os.cpu_count()} cores")
    print("| path | examples | s CPU / wall | examples/s CPU / wall | " + " | ".join(STAGES) + " |")
    print("|---|---|---|---|" + "---|" * len(STAGES))
    print("\n".join(row(r) for r in rows))
    print("cells: share of the run's CPU time of this process (CPU ms per example); ipc: wall ms per example")
    for r in rows:
        if r.get("findings"):
            print(f"{r['path']}: findings {r['findings']}")


if __name__ == "__main__":
    main()
