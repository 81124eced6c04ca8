"""A fuzzing session: targets, their budget, findings saved as they happen.

The same ``Session`` object serves an in-process run (``gradfuzz fuzz``
without ``-n``) and each pytest-xdist worker (``-n N``, through
``harness.pytest_plugin``). It owns the ``Result`` the report is made
from, saves every confirmed finding at once (``harness.artifacts.findings``: one
file per signature, counts bumped), and turns its state into a JSON
snapshot: the live display reads snapshots, xdist workers write theirs to
status files, and the controller rebuilds one ``Result`` from them, even
after an interrupt.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

from harness.artifacts import findings
from harness.artifacts.campaign import publish_finding
from harness.observation import Divergence
from harness.paths import Path
from harness.engine.result import Result, Tally
from harness.artifacts.findings import finding_entry
from harness.paths import close_paths, heaviness, in_child, shards_for, split_available
from harness.engine.target import Finding, Stop, Target, TargetRun, strategy_flags
from harness.engine.coverage import MODES, combine as combine_coverage, new_meter, request_in_children
from harness.workers.interpreter import one_thread


def plan(paths: list[Path], *, exact: bool | None, seed: int, shards: int = 1,
         slack: float | None = None, examples: int | None = None) -> list[Target]:
    """Group paths that share a case distribution; one target per group and
    shard (``shards``, or fewer for a group ``shards_for`` says so of, given
    the ``examples`` budget over all shards).

    A path that runs in a child is a group of its own: the oracle a group
    would share costs milliseconds beside its compile of each structure, and
    alone it runs on a worker beside its siblings. The gate fuzzes one shard
    per target (its verdict must not depend on ``-n``), so the six compile
    flavours in one target were one serial chain on any number of cores."""
    groups: dict[tuple, list[Path]] = {}
    for p in paths:
        groups.setdefault(strategy_flags(p) + ((p.name,) if in_child(p) else ()), []).append(p)
    # Heaviest first (a target's seed is its own, so the order changes only who waits at the end),
    # and shard by shard: with S shards per target on S workers, target-major order gave every
    # worker a shard of the heaviest target, and the light targets waited for all of them (on
    # 16 workers split.fixed ran no example for minutes while compile shards ran).
    ordered = sorted(groups.values(), key=lambda ps: -max(heaviness(p) for p in ps))
    counts = [shards_for(ps, shards, examples) for ps in ordered]
    return [Target(ps, exact=exact, seed=seed, shard=s, shards=n, slack=slack)
            for s in range(shards) for ps, n in zip(ordered, counts) if s < n]


class Session:
    def __init__(self, *, save_dir: str | None, db_spec: str | None = None, database: Any = None,
                 stop: Stop | None = None, seed: int = 0, worker: str = "main",
                 on_event: Callable[[str], None] | None = None,
                 label: Callable[[str, str], str] | None = None, coverage: str | None = None,
                 settled: Callable[[str, str], bool] | None = None) -> None:
        """``label(path, signature)`` names the known bug a finding is (the
        ledger lives above the engine: the front passes it in); ``settled``:
        which first hits are kept unshrunk (``TargetRun``). ``coverage``:
        None (off), ``measure`` or ``guide`` (``harness.engine.coverage``)."""
        if coverage is not None and coverage not in MODES:
            raise ValueError(f"coverage {coverage!r}: expected one of {MODES}")
        self.result = Result()
        self.label = label
        self.settled = settled
        self.save_dir = save_dir
        self.db_spec = db_spec
        self.database = database
        self.stop = stop or Stop()
        self.seed = seed
        self.worker = worker
        self.on_event = on_event
        self.counts: dict[str, int] = {}  # signature -> finds in this session
        self.details: dict[str, dict[str, Any]] = {}
        self.started = time.time()
        self.cpu0 = time.process_time()
        self.deadline: float | None = None  # wall clock (time.time())
        self.examples_budget: int | None = None
        self.interrupted = False
        self.done = False
        self.runs: list[TargetRun] = []
        self.coverage = coverage
        self.meter = new_meter() if coverage is not None else None  # one per process: families unioned over targets
        if coverage is not None:
            # Paths that run their case in a worker process (compile, graphed) trace there when the
            # worker starts with this set: workers start on their first case, after this.
            request_in_children()

    # -- findings -------------------------------------------------------------

    def on_finding(self, f: Finding) -> None:
        """A confirmed find: saved at once. A find of the example database's
        replay pass counts here only where the seeded stream does not make it
        again (``TargetRun.replay_only``, at the end of the target), and the
        stream's find of it again does not bump its file's count: the same
        seed and budget count the same whatever the database holds."""
        first = f.divergences[0]
        sig = first.signature
        if not f.replayed:
            self.counts[sig] = self.counts.get(sig, 0) + 1
        if sig not in self.details or f.again and self.counts[sig] == 1:
            # The stream's first find of it: the numbers a cold start gives
            # (``replayed`` stays: the database had it before the stream).
            replayed = f.replayed or sig in self.details
            self.details[sig] = {"path": f.path.name, "kind": first.kind, "detail": first.detail,
                                 "flaky": f.flaky, "examples": f.examples, "seconds": round(f.seconds, 3)}
            if replayed:
                self.details[sig]["replayed"] = True
        if self.label is not None:
            self.details[sig]["ledger"] = self.label(f.path.name, sig)
        saved = ""
        if self.save_dir:
            source = f"gradfuzz fuzz --paths {f.path.name} --seed {self.seed}"
            entry, script = finding_entry(f.path, f.case, f.divergences, source)
            rec = findings.record(self.save_dir, sig, entry, script, bump=not f.again)
            if rec.file not in self.result.saved and not f.replayed:  # replayed: listed at the end if only replayed
                self.result.saved.append(rec.file)
            self.details[sig]["file"] = rec.file
            self.details[sig]["count_in_corpus"] = rec.count
            saved = f" -> {rec.file} (found {rec.count}x)"
            if self.db_spec:
                try:
                    meta = dict(entry.meta, counts={findings.writer_id(): max(1, self.counts.get(sig, 0))})
                    publish_finding(self.db_spec, sig, {"case": f.case.to_json(), "meta": meta}, script)
                except Exception as e:  # the corpus file is saved; the shared log is a convenience
                    self.result.errors.append(f"publishing {sig} to {self.db_spec}: {e}")
        if self.on_event is not None:
            flaky = " (FLAKY: did not reproduce)" if f.flaky else ""
            flaky += " (replayed from the example database)" if f.replayed else ""
            known = f" ({self.details[sig]['ledger']})" if "ledger" in self.details[sig] else ""
            self.on_event(f"[{f.path.name}] divergence {sig}{known}: {first.detail}{flaky}{saved}")

    # -- running --------------------------------------------------------------

    def set_budget(self, examples: int | None, minutes: float | None) -> None:
        """The session's budget, one rule for every front: a wall-clock budget
        when ``minutes`` is given, else ``examples`` (100 when neither is)."""
        if minutes is not None:
            self.deadline = time.time() + minutes * 60
        self.examples_budget = examples if examples is not None else (None if minutes is not None else 100)

    def slice(self, seconds: float) -> float:
        """A ``time.monotonic()`` deadline ``seconds`` from now, never past the session's."""
        left = (self.deadline or time.time()) - time.time() if self.deadline is not None else seconds
        return time.monotonic() + max(0.0, min(seconds, left))

    def run_target(self, target: Target, *, examples: int | None, deadline: float | None,
                   heartbeat: Callable[[], None] | None = None, relative_to: dict[str, Path] | None = None) -> TargetRun:
        """``deadline`` is a ``time.monotonic()`` value."""
        if relative_to:
            target.relative_to = relative_to
        run = TargetRun(target, self.result, examples=examples, deadline=deadline, database=self.database,
                        stop=self.stop, on_finding=self.on_finding, heartbeat=heartbeat, meter=self.meter,
                        guide=self.coverage == "guide", settled=self.settled)
        self.runs.append(run)
        try:
            run.run()
        except Exception as e:  # a harness error (the oracle failed): report it, keep the session
            self.result.errors.append(f"{target.name} (shard {target.shard}): {type(e).__name__}: {e}")
        for f in run.replay_only():
            sig = f.divergences[0].signature
            self.counts[sig] = self.counts.get(sig, 0) + 1
            file = self.details.get(sig, {}).get("file")
            if file and file not in self.result.saved:
                self.result.saved.append(file)
        if run.interrupted:
            self.interrupted = True
        return run

    def available(self, paths: list[Path]) -> list[Path]:
        live, unavailable = split_available(paths)
        self.result.unavailable.update(unavailable)
        for name, why in unavailable.items():
            if self.on_event is not None:
                self.on_event(f"[{name}] not run: unavailable ({why})")
        return live

    # -- snapshots ------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        r = self.result
        snap = {
            "worker": self.worker,
            "pid": os.getpid(),
            "started": self.started,
            "updated": time.time(),
            "cpu_s": time.process_time() - self.cpu0,
            "deadline": self.deadline,
            "examples_budget": self.examples_budget,
            "done": self.done,
            "interrupted": self.interrupted,
            "paths": {n: _tally_json(t) for n, t in r.paths.items()},
            "unavailable": dict(r.unavailable),
            "divergences": [d.to_json() for d in r.divergences],
            "counts": dict(self.counts),
            "details": dict(self.details),
            "saved": list(r.saved),
            "errors": list(r.errors),
        }
        if self.meter is not None:
            snap["coverage"] = self.meter.to_json()
        return snap


def _tally_json(t: Tally) -> dict[str, Any]:
    return {"examples": t.examples, "run": t.run, "skipped": dict(t.skipped), "seconds": t.seconds,
            "first_hit_examples": t.first_hit_examples, "first_hit_seconds": t.first_hit_seconds,
            "replayed": t.replayed, "per_example": t.per_example, "ops": sorted(t.ops), "unjudged": t.unjudged,
            "finished": t.finished}


def combine(snapshots: list[dict[str, Any]]) -> tuple[Result, dict[str, Any]]:
    """Worker snapshots -> one Result (tallies summed, seconds the longest)
    and the combined counts/details for the display and the JSON record."""
    result = Result()
    counts: dict[str, int] = {}
    details: dict[str, dict[str, Any]] = {}
    interrupted = False
    cpu = 0.0
    coverage = combine_coverage(s.get("coverage") for s in snapshots if s.get("coverage") is not None)
    for s in snapshots:
        interrupted |= bool(s.get("interrupted"))
        cpu += s.get("cpu_s", 0.0)
        for name, t in s.get("paths", {}).items():
            tally = result.paths.setdefault(name, Tally())
            tally.examples += t["examples"]
            tally.replayed += t.get("replayed", 0)
            tally.per_example = max(tally.per_example, int(t.get("per_example", 1)))
            tally.run += t["run"]
            tally.ops.update(t.get("ops", ()))
            tally.unjudged += int(t.get("unjudged", 0))
            tally.finished += int(t.get("finished", 0))
            for reason, n in t["skipped"].items():
                tally.skipped[reason] = tally.skipped.get(reason, 0) + n
            tally.seconds = max(tally.seconds, t["seconds"])
            if t.get("first_hit_seconds") is not None and (
                    tally.first_hit_seconds is None or t["first_hit_seconds"] < tally.first_hit_seconds):
                tally.first_hit_examples, tally.first_hit_seconds = t["first_hit_examples"], t["first_hit_seconds"]
        result.unavailable.update(s.get("unavailable", {}))
        result.divergences.extend(Divergence.from_json(d) for d in s.get("divergences", []))
        for f in s.get("saved", []):
            if f not in result.saved:
                result.saved.append(f)
        result.errors.extend(s.get("errors", []))
        for sig, n in s.get("counts", {}).items():
            counts[sig] = counts.get(sig, 0) + n
        for sig, d in s.get("details", {}).items():
            details.setdefault(sig, d)
    extra: dict[str, Any] = {"counts": counts, "details": details, "interrupted": interrupted, "cpu_s": cpu}
    if coverage:
        extra["coverage"] = coverage
    return result, extra


def write_status(file: str, snapshot: dict[str, Any]) -> None:
    from harness.artifacts.corpus import atomic_write

    atomic_write(file, json.dumps(snapshot))


def read_statuses(run_dir: str) -> list[dict[str, Any]]:
    out = []
    if not os.path.isdir(run_dir):
        return out
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("status-") and name.endswith(".json"):
            try:
                with open(os.path.join(run_dir, name)) as fh:
                    out.append(json.load(fh))
            except (OSError, ValueError):
                continue  # replaced under us: the next poll reads the new one
    return out


def fuzz(paths: list[Path], *, examples: int | None = None, minutes: float | None = None, seed: int = 0,
         save_dir: str | None = None, exact: bool | None = None, db: str | None = "none", stop: Stop | None = None,
         on_event: Callable[[str], None] | None = None, session: Session | None = None,
         slack: float | None = None, settled: Callable[[str, str], bool] | None = None) -> Session:
    """An in-process session over ``paths`` (one shard per target)."""
    from harness.engine.database import open_database

    session = session or Session(save_dir=save_dir, db_spec=db, database=open_database(db), stop=stop, seed=seed,
                                 on_event=on_event, settled=settled)
    _single_thread()
    session.set_budget(examples, minutes)
    examples = session.examples_budget
    start = time.monotonic()
    try:
        live = session.available(paths)
        targets = plan(live, exact=exact, seed=seed, slack=slack)
        for i, t in enumerate(targets):
            if session.stop():
                session.interrupted = True
                break
            if session.on_event is not None:
                budget = f"{examples} examples" if examples is not None else \
                    f"~{max(0.0, (minutes or 0) * 60 - (time.monotonic() - start)) / (len(targets) - i):.0f}s"
                session.on_event(f"[phase] fuzz target {i + 1}/{len(targets)}: {t.name} ({budget})")
            deadline = None
            if minutes is not None:
                deadline = session.slice((minutes * 60 - (time.monotonic() - start)) / (len(targets) - i))
            session.run_target(t, examples=examples, deadline=deadline)
    finally:
        session.done = True
        close_paths(paths)
    return session


def _single_thread() -> None:
    """Cases are tiny: intra-op threads only contend with other workers."""
    try:
        import torch

        if torch.get_num_threads() != 1 and one_thread():
            torch.set_num_threads(1)
    except Exception:  # pragma: no cover - torch is a dependency
        print("gradfuzz: could not limit torch threads", file=sys.stderr)
