"""``gradfuzz fuzz`` as a session: in this process, or ``-n N`` through pytest-xdist.

Both ways a session saves each finding the moment it is confirmed (one
corpus file per signature), keeps an example database that outlives the
run, shows progress, and on Ctrl-C stops between examples, prints the
summary so far, writes ``--json`` and exits 130.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

from harness.artifacts import timings
from harness.case.schema import ascii_int
from harness.paths import Options, UsageError


def add_arguments(f: argparse.ArgumentParser) -> None:
    f.add_argument("-n", "--numprocesses", metavar="N|auto",
                   help="run the fuzz targets on N processes through pytest-xdist ('auto': one per core)")
    f.add_argument("--db", metavar="DIR|redis://HOST:PORT/N|none",
                   help="Hypothesis example database: saved failures are replayed first "
                        "(default .gradfuzz/examples; redis:// shares one campaign between machines)")
    f.add_argument("--shards", type=int, help="shards per fuzz target with -n (default: one per process; fewer for "
                   "a target of child paths on a small examples budget)")
    f.add_argument("--progress", choices=("auto", "live", "plain", "none"), default="auto",
                   help="live display on a terminal, plain periodic lines otherwise (default auto)")
    f.add_argument("--progress-every", type=float, default=10.0, metavar="S",
                   help="seconds between plain progress lines (default 10)")
    f.add_argument("--coverage", nargs="?", const="measure", choices=("measure", "guide"), default=None,
                   help="measure line and arc coverage of the machinery each family tests (its torch files only) "
                        "and report it in the summary; 'guide' also steers Hypothesis towards examples that reach "
                        "new machinery lines (local sessions: docs/fuzzing.md). Off by default: tracing slows "
                        "every example")
    add_confirm_argument(f)
    f.add_argument("--keep-run-dir", action="store_true", help=argparse.SUPPRESS)


def add_confirm_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--confirm-seconds", type=float, default=120.0, metavar="S",
                   help="at the end, run the gate's causal check (the bug's workaround or fix probe) on each finding "
                        "the ledger fits, for at most S seconds, and say known or new (default 120; 0: off)")


def _option_overrides(options: Options) -> dict[str, Any]:
    return options.flat()


def run(args: argparse.Namespace, options: Options, exact: bool | None, paths: list | None = None) -> int:
    from harness.cli import report
    from harness.engine.database import DatabaseError
    from harness.cli.pathnames import resolve_paths as resolve
    from harness.cli.progress import Display

    if paths is None:
        paths = resolve(args.paths, options)  # unknown names are a usage error before anything starts
    if args.examples is not None and args.minutes is not None:
        raise UsageError("give --examples or --minutes, not both")
    n = args.numprocesses
    if n is not None and n != "auto" and ascii_int(n) is None:
        raise UsageError(f"-n {n!r}: expected a number of processes or 'auto'")
    try:
        if n is None or n == "0":
            result, extra = _in_process(args, paths, exact, Display)
        else:
            unavailable = {p.name: a.reason for p in paths if not (a := p.availability()).ok}
            live = [p for p in paths if p.name not in unavailable]
            result, extra = _parallel(args, options, n, Display, unavailable, planned(live, args.examples))
    except DatabaseError as e:
        raise UsageError(str(e)) from None
    interrupted = extra.get("interrupted", False)
    text = report.summary(result)
    if interrupted:
        text = text.replace("gradfuzz: fuzzed", "gradfuzz: INTERRUPTED; so far fuzzed", 1)
    counts = extra.get("counts", {})
    coverage = extra.get("coverage") or {}
    print(text + _tail(result, extra, args.save), flush=True)
    confirmed = confirm_findings(result, paths, args) if not interrupted else {}
    if args.json:
        data = report.to_json(result)
        data.update(interrupted=interrupted, signal=signal.Signals(extra.get("signal", signal.SIGINT)).name if interrupted else None,
                    counts=counts, findings=extra.get("details", {}), confirmed=confirmed or None,
                    workers=extra.get("workers", 1),
                    coverage={f: {"lines": len(c.lines), "of": c.total, "files": c.files, "arcs": len(c.arcs),
                                  "traced_runs": c.examples, "reached": c.to_json()["lines"]}
                              for f, c in sorted(coverage.items())} or None,
                    seconds=round(extra.get("seconds", 0.0), 3), cpu_s=round(extra.get("cpu_s", 0.0), 3))
        from harness.artifacts.corpus import atomic_write

        atomic_write(args.json, json.dumps(data, indent=1) + "\n")
    if interrupted:
        return exit_code(extra.get("signal", signal.SIGINT))
    if result.divergences:
        return 1
    return 2 if result.errors else 0


def confirm_findings(result: Any, paths: list, args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """The gate's causal check, once per finding the ledger fits (a fuzzing
    session's own labels say only "resembles"), printed as it runs; what it
    said per "path signature", for the JSON report."""
    budget = getattr(args, "confirm_seconds", 0.0)
    if not result.divergences or not budget or budget <= 0:
        return {}
    from harness import project
    from harness.gate.confirm import confirm

    live = [p for p in paths if p.availability().ok]
    done, left = confirm(result.divergences, live, project.ledger_file(getattr(args, "ledger", None)), budget,
                         lambda line: print(line, file=sys.stderr, flush=True))
    if not done and not left:
        return {}
    print(f"known or new (the gate's check of each finding the ledger fits; {len(done)} checked"
          f"{f', {left} left: time budget spent (--confirm-seconds {budget:g}); `gradfuzz gate` checks all' if left else ''}):")
    for (path, sig), c in done.items():
        print(f"  {path} [{sig}]: {c.label()}")
    sys.stdout.flush()
    return {f"{path} {sig}": {"status": c.status, "bug": c.bug, "note": c.note} for (path, sig), c in done.items()}


def _tail(result: Any, extra: dict, save: str | None) -> str:
    """The summary's end: finds by signature, coverage, errors, and where the findings went."""
    text = ""
    counts = extra.get("counts", {})
    if counts:
        text += (f"\nfinds by signature (this session; {sum(counts.values())} finds, a find being a failing case "
                 "with one or more of the divergences above):")
        for sig, c in sorted(counts.items(), key=lambda kv: -kv[1]):
            d = extra.get("details", {}).get(sig, {})
            first = f", first after {d['examples']} example(s) ({d['seconds']:.2f}s)" if d.get("examples") is not None else ""
            known = f" ({d['ledger']})" if d.get("ledger") else ""
            text += f"\n  {sig}{known}: {c}x{first}"
    coverage = extra.get("coverage") or {}
    if coverage:
        from harness.engine.coverage import summary_lines

        text += "".join(f"\n{line}" for line in summary_lines(coverage))
    for e in result.errors:
        text += f"\nerror: {e}"
    if save:
        from harness.cli.report import findings_note

        text += f"\n{findings_note(save, result.saved)}"
    return text


def _in_process(args: argparse.Namespace, paths: list, exact: bool | None, Display: Any) -> tuple[Any, dict]:
    from harness.engine import session as sessions
    from harness.engine.database import open_database
    from harness.engine.target import Stop

    stop = Stop()
    from harness.gate.ledger import labeller

    s = sessions.Session(save_dir=args.save, db_spec=args.db, database=open_database(args.db), stop=stop,
                         seed=args.seed, label=labeller(getattr(args, "ledger", None)),
                         coverage=getattr(args, "coverage", None))
    total = planned([p for p in paths if p.availability().ok], args.examples)
    display = Display(lambda: {**s.snapshot(), "planned": total}, args.progress, args.progress_every)
    s.on_event = display.event
    got: list[int] = []
    previous = _on_signals(stop, display, got)
    start = time.monotonic()
    display.start()
    try:
        sessions.fuzz(paths, examples=args.examples, minutes=args.minutes, seed=args.seed, exact=exact,
                      session=s)
    finally:
        display.close()
        _restore(previous)
    from harness.engine.coverage import combine as combine_coverage

    coverage = combine_coverage([s.meter.to_json()]) if s.meter is not None else {}
    return s.result, {"counts": s.counts, "details": s.details, "interrupted": s.interrupted or stop.requested,
                      "seconds": time.monotonic() - start, "signal": got[0] if got else signal.SIGINT,
                      "coverage": coverage}


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, and what CI runners and ``timeout`` send


def _on_signals(stop: Any, display: Any, got: list[int]) -> dict[int, Any]:
    """First SIGINT or SIGTERM: stop between examples and report; the second: now."""

    def handler(signum: int, frame: Any) -> None:
        if stop.requested:
            raise KeyboardInterrupt
        got.append(signum)
        stop.set()
        display.stopping = True
        print(f"\ngradfuzz: interrupted ({signal.Signals(signum).name}): finishing the current example, saving, "
              "then the summary (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    return {s: signal.signal(s, handler) for s in STOP_SIGNALS}


def _restore(previous: dict[int, Any]) -> None:
    for s, h in previous.items():
        signal.signal(s, h)


def exit_code(signum: int) -> int:
    """The shell's code for a run stopped by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


def planned(live: list, examples: int | None) -> int | None:
    """The examples an ``--examples`` budget comes to over every target of
    ``live``, counted before the run: the progress total is then fixed from
    the first line, not grown as workers reach targets (640, then 2,960), and
    its ETA can be trusted. Shards split a target's budget exactly, so their
    number does not change it. None for a time budget (its end is known)."""
    if not examples or not live:
        return None
    from harness.engine.session import plan

    return sum(examples * t.variants * len(t.paths) for t in plan(live, exact=None, seed=0, examples=examples))


def _parallel(args: argparse.Namespace, options: Options, n: str, Display: Any,
              unavailable: dict[str, str], total: int | None = None) -> tuple[Any, dict]:
    from harness.engine import parallel
    from harness.engine.database import open_database
    from harness.engine.session import combine, read_statuses

    open_database(args.db)  # a bad --db is a usage error here, not in every worker
    run_dir = parallel.new_run_dir()
    cmd = parallel.pytest_command(
        run_dir, workers=n, paths=args.paths, examples=args.examples, minutes=args.minutes, seed=args.seed,
        mode=args.mode, db=args.db, save=args.save, shards=args.shards, options=_option_overrides(options),
        extra_paths=list(options.extra), ledger=getattr(args, "ledger", None), coverage=getattr(args, "coverage", None),
        settle_known=getattr(args, "settle_known", False))
    ctl = parallel.Controller(cmd, run_dir, n)
    ctl.unavailable = unavailable
    plan = _plan_key(args)
    history = timings.load_or_reference(plan) if plan else {}
    display = Display(lambda: {**ctl.view(), "planned": total, "history": history}, args.progress,
                      args.progress_every)

    stop = _Stopper(ctl, display, parallel.TERM_GRACE)
    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    start = time.monotonic()
    ctl.start()
    display.start()
    try:
        rc = ctl.wait()
    finally:
        display.close()
        _restore(previous)
    snaps = read_statuses(run_dir)
    result, extra = combine(snaps)
    result.unavailable.update(unavailable)
    extra["workers"] = len(snaps)
    extra["seconds"] = time.monotonic() - start
    extra["interrupted"] = extra["interrupted"] or stop.requested
    extra["signal"] = stop.got[0] if stop.got else signal.SIGINT
    if not snaps or rc not in (0, 1):
        if not stop.requested or not snaps:
            result.errors.append(f"pytest-xdist session exited {rc}; its log ({ctl.log}):\n{ctl.log_tail()}")
    parallel.cleanup(run_dir, keep=args.keep_run_dir or bool(result.errors))
    if plan and not result.errors and not extra["interrupted"]:
        timings.save(plan, {name: t.seconds for name, t in result.paths.items()})
    return result, extra


class _Stopper:
    """The signal handler of a run on workers: the first Ctrl-C lets them
    finish their example and save, a second ends them; SIGTERM is a
    deadline (CI cancel, ``timeout``): findings are saved as they happen, so
    the workers get ``term_grace`` seconds, not the Ctrl-C grace."""

    def __init__(self, ctl: Any, display: Any, term_grace: float) -> None:
        self.ctl, self.display, self.term_grace = ctl, display, term_grace
        self.requested = False
        self.got: list[int] = []

    def __call__(self, signum: int, frame: Any) -> None:
        first = not self.requested
        self.got.append(signum)
        self.requested = True
        self.ctl.request_stop(self.term_grace if signum == signal.SIGTERM else None)
        self.display.stopping = True
        if first:
            print("\ngradfuzz: interrupted: workers finish their current example and save "
                  "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)


def _plan_key(args: argparse.Namespace) -> str | None:
    """The plan whose last run times the progress estimate (an examples budget only: minutes end on the clock)."""
    import torch

    if not args.examples or args.minutes:
        return None
    return timings.plan_key(args.paths or "", args.examples, args.seed, torch.__version__)


def on_workers(options: Options, n: str, ledger: str | None = None) -> Any:
    """The gate's fuzzing phase on ``n`` pytest-xdist workers.

    One shard per target, so each target draws the cases it would draw in
    one process: the verdict does not depend on ``n`` or on which worker ran
    what (only the wall time does). ``ledger``: the gate's, so the workers
    label findings against the same file."""
    from harness.cli.progress import Display

    def run(live: list, *, examples: int | None, minutes: float | None, seed: int, save_dir: str | None,
            progress: Any = None, slack: float | None = None) -> Any:
        if slack is not None:
            raise UsageError("--tolerance-slack needs the fuzzing in this process: leave out -n")
        args = argparse.Namespace(paths=",".join(p.name for p in live), examples=examples, minutes=minutes, seed=seed,
                                  mode="both", db="none", save=save_dir, shards=1, progress="plain",
                                  progress_every=30.0, keep_run_dir=False, ledger=ledger, settle_known=True)
        result, extra = _parallel(args, options, n, Display, {}, planned(live, examples))
        if extra.get("interrupted"):
            # SIGTERM from a CI timeout stops the workers between examples; what
            # did not run cannot have passed, so the gate fails with the reason.
            sig = signal.Signals(extra.get("signal", signal.SIGINT)).name
            ran = sum(t.examples for t in result.paths.values())
            budget = f"{examples} example(s) per target" if examples else f"{minutes} minute(s)"
            result.errors.append(f"fuzzing stopped by {sig} after {ran} example(s), before its budget of {budget} "
                                 "ran: an interrupted gate cannot pass")
        return result

    return run


def add_merge_parser(sub: Any) -> None:
    from harness.artifacts.findings import DEFAULT_DIR as DEFAULT_FOUND

    m = sub.add_parser("merge", help="merge the findings of several machines (corpus dirs, redis://) into one corpus")
    m.add_argument("sources", nargs="+", metavar="DIR|redis://HOST:PORT/N",
                   help="corpus directories (copied from each machine) or a campaign's Redis")
    m.add_argument("--into", default=DEFAULT_FOUND, metavar="DIR",
                   help=f"the findings folder to merge into (default {DEFAULT_FOUND})")
    m.set_defaults(func=cmd_merge)


def cmd_merge(args: argparse.Namespace) -> int:
    from harness.artifacts import findings
    from harness.engine.database import DatabaseError

    try:
        summary = findings.merge(args.sources, args.into)
    except DatabaseError as e:
        raise UsageError(str(e)) from None
    print(f"gradfuzz: merged {len(args.sources)} source(s) into {summary['into']}: "
          f"{summary['signatures']} signature(s), {summary['new']} new")
    for sig, count in sorted(summary["counts"].items(), key=lambda kv: -kv[1]):
        print(f"  {sig}: found {count}x")
    return 0
