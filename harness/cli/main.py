"""``gradfuzz``: fuzz, replay, repro, paths.

Exit codes: 0 no divergence (or only known ones), 1 divergence found, 2 usage
or setup error (a bad flag, an unimportable ``--split-impl``, no ledger or
corpus to be found): nothing was tested.
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import os
import sys
import time
import warnings
from typing import Any

# torch warns at import when NumPy is absent; gradfuzz does not need NumPy.
warnings.filterwarnings("ignore", message=".*NumPy.*")

from harness.artifacts import corpus
from harness.artifacts import repro
from harness.artifacts.corpus import CorpusError
from harness.artifacts.text import escaped_output
from harness.cli.pathnames import resolve_paths as resolve
from harness.paths import Options, UsageError
from harness.case.spec import SCHEMA_VERSION, SpecError


def _options(args: argparse.Namespace) -> Options:
    impls = tuple((u.option, getattr(args, u.option)) for u in _user_impls() if getattr(args, u.option, None))
    return Options(
        impls=impls,
        backend=args.backend,
        world_size=args.world_size,
        timeout=args.timeout,
        extra=tuple(args.path or ()),
    )


def _user_impls() -> list:
    from harness.paths import families

    return [u for f in families() for u in f.user_impls]


def _add_path_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--paths", help="comma-separated path names or families (default: all)")
    for u in _user_impls():  # each family's flags that point its paths at the user's code
        p.add_argument(u.flag, dest=u.option, metavar="MODULE[:ATTR]", help=f"your own code behind the path: {u.wants}")
    p.add_argument("--backend", "--dtensor-backend", dest="backend", choices=("gloo", "nccl"),
                   help="process-group backend of the multi-process paths (default: nccl with a GPU per rank, else gloo)")
    p.add_argument("--world-size", type=int, default=2, help="ranks for process-group paths (default 2)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per case before a multi-process path is declared hung")
    p.add_argument("--path", action="append", metavar="MODULE:ATTR", help="add a third-party path (repeatable)")


def _writable(path: str, flag: str, directory: bool = False) -> None:
    """Fail before the run, not after it, when an output cannot be written:
    create the folder it goes in and a scratch file there (permission bits
    alone say nothing to root)."""
    import os
    import tempfile

    p = os.path.abspath(path)
    if os.path.exists(p) and directory != os.path.isdir(p):
        raise UsageError(f"{flag} {path}: is {'not ' if directory else ''}a directory")
    folder = p if directory else os.path.dirname(p)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=folder, prefix=".gradfuzz-writable-")
        os.close(fd)
        os.unlink(scratch)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write there ({e.strerror}: {e.filename})") from None


def check_args(args: argparse.Namespace) -> None:
    """Usage errors (exit 2) before any work: budgets, counts, outputs.

    A typo in CI (``--examples 0``, ``--minutes -1``) must not read as a
    clean pass, and an unwritable ``--json`` must not be found after an
    hour of fuzzing."""
    import math
    import os

    cmd = args.command
    examples = getattr(args, "examples", None)
    if examples is not None and examples < 1:
        raise UsageError(f"--examples {examples}: expected at least 1 example per path")
    minutes = getattr(args, "minutes", None)
    if minutes is not None:
        lowest = 0.0 if cmd == "gate" else None  # gate --minutes 0: replay only
        if not math.isfinite(minutes) or minutes < 0 or (lowest is None and minutes == 0):
            raise UsageError(f"--minutes {minutes}: expected a positive number of minutes"
                             + (" (0: replay only)" if cmd == "gate" else ""))
    if getattr(args, "world_size", 2) is not None and not 1 <= getattr(args, "world_size", 2) <= 64:
        raise UsageError(f"--world-size {args.world_size}: expected 1..64 ranks")
    timeout = getattr(args, "timeout", 10.0)
    if timeout is not None and (not math.isfinite(timeout) or not 0 < timeout <= 86400):
        raise UsageError(f"--timeout {timeout}: expected a positive number of seconds (at most 86400)")
    every = getattr(args, "progress_every", 10.0)
    if every is not None and (not math.isfinite(every) or every <= 0):
        raise UsageError(f"--progress-every {every}: expected a positive number of seconds")
    shards = getattr(args, "shards", None)
    if shards is not None and shards < 1:
        raise UsageError(f"--shards {shards}: expected at least 1")
    seed = getattr(args, "seed", 0)
    if seed is not None and not 0 <= seed < 2**63:
        raise UsageError(f"--seed {seed}: expected 0..2**63-1")
    n = getattr(args, "numprocesses", None)
    if n is not None:
        if n != "auto" and not (n.isdigit() and n.isascii()):
            raise UsageError(f"-n {n!r}: expected a number of processes or 'auto'")
        cores = os.cpu_count() or 1
        if n != "auto" and int(n) > cores:
            print(f"gradfuzz: warning: -n {n} is more than the {cores} core(s) here: capped at -n {cores}",
                  file=sys.stderr)
            args.numprocesses = str(cores)
    for flag in ("json", "junit", "markdown", "html"):
        if getattr(args, flag, None):
            _writable(getattr(args, flag), f"--{flag}")
    if getattr(args, "save", None):
        _writable(args.save, "--save", directory=True)
    if getattr(args, "into", None):
        _writable(args.into, "--into", directory=True)
    _project_data(args)


def _project_data(args: argparse.Namespace) -> None:
    """The ledger and corpus a command reads by default come from the
    installed project, not the working directory (``harness.project``);
    one that cannot be found is a usage error here, before any work."""
    from harness import project

    if hasattr(args, "ledger"):
        args.ledger = project.ledger_file(args.ledger)
    if args.command == "gate":
        args.corpus = project.corpus_dirs(args.corpus, fix="pass --corpus DIR (or --corpus alone for none)")
    if args.command == "replay" and not args.targets:
        args.targets = project.corpus_dirs(None, fix="name the corpus files or directories to replay")


def cmd_fuzz(args: argparse.Namespace) -> int:
    paths = resolve(args.paths, _options(args))
    if args.examples is not None and args.minutes is not None:
        raise UsageError("give --examples or --minutes, not both")
    from harness.generate import MODES

    exact = MODES[args.mode]
    if args.seed is None:  # a local session explores a new stream; the printed seed replays it
        import random

        args.seed = random.SystemRandom().randrange(2**31)
        print(f"gradfuzz fuzz: seed {args.seed} (--seed {args.seed} draws the same cases again)", file=sys.stderr)
    from harness.cli import fuzz as fuzz_command  # sessions: -n N, --db, live progress, findings saved as they happen

    return fuzz_command.run(args, _options(args), exact, paths)


def cmd_replay(args: argparse.Namespace) -> int:
    from harness.cli import report
    from harness.engine import runner

    skipped: list[str] = []
    files = corpus.discover(args.targets, skipped)
    for d in skipped:
        print(f"gradfuzz: {d} holds findings, not filed cases: not replayed (name it to replay it)", file=sys.stderr)
    if not files:
        raise UsageError(f"no corpus files (*.json) under {' '.join(args.targets)}")
    for f in files:  # every file read and checked before any path is built
        corpus.load(f)
    for f in files if args.migrate else ():
        if corpus.migrate(f):
            print(f"gradfuzz: {f}: rewritten in case schema {SCHEMA_VERSION}", file=sys.stderr)
    import collections

    import torch

    from harness.cli import replay as verdict

    paths = resolve(args.paths, _options(args))
    counts: collections.Counter = collections.Counter()
    per_path: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def tally(r) -> None:
        if r.skipped is None:
            status = verdict.status(r.entry, r.path.name, bool(r.divergences), torch.__version__)
            counts[status] += 1
            per_path[r.path.name][status or "agree"] += 1

    result = runner.replay(files, paths, progress=lambda s: print(s, file=sys.stderr) if args.verbose else None,
                           each=tally)
    print(report.summary(result, verb=f"replayed {len(files)} case(s),", verdicts=per_path))
    print(verdict.line(counts, len(result.unavailable)))
    from harness.cli.fuzz import confirm_findings

    confirm_findings(result, paths, args)
    if args.json:
        report.write_json(result, args.json)
    return 1 if result.divergences else 0


def cmd_repro(args: argparse.Namespace) -> int:
    from harness.engine import runner

    entry = corpus.load(args.case)
    found_on = entry.meta.get("found_with", {}).get("path")
    try:
        paths = resolve(args.paths or found_on or None, _options(args))
    except UsageError as e:
        if args.paths or not found_on:
            raise
        raise UsageError(f"{args.case} was found on {found_on!r}, which is not a path here: a third-party path "
                         f"needs the same --path MODULE:ATTR it was fuzzed with ({e})") from None
    status = 0
    # With --script the standalone script is the only thing on stdout (`> repro.py` runs as is).
    say = (lambda s: print(s, file=sys.stderr)) if args.script else print
    for p in paths:
        a = p.availability()
        if not a.ok:
            say(f"{p.name}: not run, unavailable here: {a.reason}")
            continue
        reason = p.supports(entry.case)
        if reason:
            say(f"{p.name}: not run, case outside its contract: {reason}")
            continue
        divs = runner.check(entry.case, p)
        say(f"{p.name}: {'DIVERGES' if divs else 'agrees with the oracle'}")
        for d in divs:
            say(f"  {d.kind} [{d.signature}] {d.detail}")
        if divs:
            status = 1
        if args.script:
            print(repro.script(entry.case, p.name, p.repro(entry.case)))
    return status


def cmd_paths(args: argparse.Namespace) -> int:
    paths = resolve(args.paths, _options(args))
    wide = max([22] + [len(p.name) for p in paths])  # one column for every name, however long
    for p in paths:
        a = p.availability()
        state = "available" if a.ok else "UNAVAILABLE"
        print(f"{p.name:<{wide}} {state:<12} {a.reason}")
    return 0


def cmd_selfcheck(args: argparse.Namespace) -> int:
    from harness.canaries import select
    from harness.gate.selfcheck import selfcheck, to_json
    from harness.artifacts.corpus import atomic_write

    results = selfcheck(args.seed, progress=lambda s: print(s, file=sys.stderr), slack=args.tolerance_slack,
                        canaries=select(args.canaries), workers=_workers(args.numprocesses))
    if args.json:
        atomic_write(args.json, to_json(results))
    missed = [r for r in results if r.state in ("missed", "broken")]
    for r in results:
        state = {"skipped": f"skipped: {r.skipped}", "caught": "caught", "broken": f"BROKEN: {r.broken}",
                 "missed": f"NOT CAUGHT: {r.detail}"}[r.state]
        print(f"  {r.name:<28} {state}" + (f" after {r.examples} examples ({r.seconds:.1f}s)" if r.caught else ""))
        if r.caught:  # what was caught, so a reader can see it is the injected bug and not the canary crashing
            print(f"      {r.detail}")
    skipped = sum(r.state == "skipped" for r in results)
    print(f"gradfuzz selfcheck: {sum(r.caught for r in results)}/{len(results)} canaries caught"
          + (f", {skipped} skipped" if skipped else "") + ("" if not missed else
          "; MISSED: " + ", ".join(r.name for r in missed) + " (detection is broken on this installation)"))
    return 1 if missed else 0


def _workers(n: str | None) -> int:
    """``-n N|auto`` (checked by ``check_args``) as a number of processes."""
    if n is None:
        return 1
    return (os.cpu_count() or 1) if n == "auto" else max(1, int(n))


def cmd_gate(args: argparse.Namespace) -> int:
    import json
    import os

    from harness.gate import run as gate
    from harness.cli.progress import PhaseLines, line_width
    from harness.cli import report as cli_report
    from harness.gate import report as gate_report
    from harness.artifacts.corpus import atomic_write
    from harness.artifacts.text import relative, scrub_tree

    from harness.gate import ledger

    # Every input read and checked before the self-check, the paths or the replay start.
    ledger.load(args.ledger)
    for f in corpus.discover(args.corpus):
        corpus.load(f)
    base = ledger.load_report(args.baseline) if args.baseline else None
    options = _options(args)
    paths = resolve(args.paths, options)
    minutes = args.minutes if args.minutes is not None or args.examples is not None else 2.0
    fuzzer = None
    if args.numprocesses not in (None, "0", "1"):
        from harness.cli import fuzz as fuzz_command

        fuzzer = fuzz_command.on_workers(options, args.numprocesses, ledger=args.ledger)
    started = time.time()
    report = gate.run_gate(paths, corpus_dirs=args.corpus, ledger_file=args.ledger, minutes=minutes, examples=args.examples,
                           seed=args.seed, save_dir=args.save, run_selfcheck=not args.no_selfcheck, fuzzer=fuzzer,
                           workers=_workers(args.numprocesses), options=options,
                           progress=PhaseLines(verbose=args.verbose), slack=args.tolerance_slack)
    rep = report.to_json()
    if base is not None:
        print("\n".join(gate.compare_baseline(rep, base, [p.name for p in paths] if args.paths else None)))
    where = {"save_dir": args.save, "full": args.json}  # repro links and "see FILE" in the reports
    # Written before the terminal report, which says where: its "see FILE" names a file that exists.
    atomic_write(args.json, json.dumps(scrub_tree(rep), indent=1) + "\n")  # no path of this machine in a file that travels
    atomic_write(args.markdown, gate_report.markdown(rep, **where, at=args.markdown))
    if args.junit:
        atomic_write(args.junit, gate_report.junit(rep, save_dir=args.save))
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as f:
            f.write(gate_report.markdown(rep, **where))
    if args.html:
        from harness.gate import html as gate_html

        atomic_write(args.html, gate_html.html_page(rep, **where))
    written = [f"{relative(args.json)} (every row)"] + [relative(f) for f in (args.markdown, args.junit, args.html) if f]
    notes = [f"reports: {', '.join(written)}", cli_report.findings_note(args.save, _findings_since(args.save, started))]
    print(gate_report.terminal(rep, width=line_width(sys.stdout), notes=notes, **where))  # the verdict first and last
    return 1 if report.failed else 0


def _findings_since(folder: str, since: float) -> list[str]:
    """The finding files written in ``folder`` since ``since`` (new ones, and old ones found again)."""
    try:
        names = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".json")]
        return [f for f in names if os.path.getmtime(f) >= since - 1]
    except OSError:
        return []


def cmd_ledger(args: argparse.Namespace) -> int:
    import torch

    from harness.gate import audit as audit_mod
    from harness.observation import SIGNATURE_SCHEME
    from harness.paths import close_paths, split_available

    if args.rescheme and audit_mod.rescheme(args.ledger):
        print(f"gradfuzz ledger: {args.ledger} moved to signature scheme {SIGNATURE_SCHEME}; its old signatures were dropped")
    selected = resolve(args.paths, _options(args))
    live, unavailable = split_available(selected)
    only, keys, outside = _entries_on(args.ledger, [p.name for p in selected]) if args.paths else (None, None, 0)
    try:
        found = audit_mod.audit(args.ledger, live, torch.__version__, only=only)
    finally:
        close_paths(live)
    if keys is not None:  # an id with entries on several families: those on unselected paths are not news
        found.skipped = {k: why for k, why in found.skipped.items() if k in keys}
    wrote = audit_mod.record(args.ledger, found.problems) if args.write else 0
    for p in found.problems:
        print(f"  {p.kind.upper():<10} {p.bug} on {p.path}" + (f" [{p.signature}]" if p.signature else "") + f": {p.detail}")
    for p in found.shared:
        print(f"  shared     {p.bug} on {p.path} [{p.signature}]: {p.detail}")
    for bug, why in sorted(found.skipped.items()):
        print(f"  skipped    {bug}: {why}")
    failing = found.failing(wrote=args.write)
    print(f"gradfuzz ledger: {len(found.checked)} places checked ({found.replays} replays) on torch {torch.__version__}, "
          f"{len(found.skipped)} skipped here, {len(found.problems)} problem(s)"
          + (f", {wrote} signature(s) recorded in {args.ledger}" if args.write else "")
          + (f", {outside} places on paths outside --paths {args.paths} not checked" if outside else "")
          + ("" if not failing else " (unrecorded or misfiled: --write records them under the entries whose cases show "
             "them; silent: fix the entry's range or cases)"))
    return 1 if failing else 0


def _entries_on(ledger_file: str, names: list[str]) -> tuple[set[str], set[str], int]:
    """The ids and places (``ID on PATH``, as the audit names them) of the
    ledger covering one of ``names`` (the --paths selection), and how many
    places cover none: those are not checked, and not reported as "no
    path matching it runs here"."""
    from harness.gate import ledger

    bugs = ledger.load(ledger_file).sites
    mine = [b for b in bugs if any(b.covers(n) for n in names)]
    return {b.id for b in mine}, {f"{b.id} on {b.path}" for b in mine}, len(bugs) - len(mine)


def cmd_table(args: argparse.Namespace) -> int:

    from harness.gate.ledger import load_report
    from harness.gate.versions import table

    print(table([load_report(f) for f in args.reports]))
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        mine = version("gradfuzz")
    except PackageNotFoundError:
        mine = "(not installed)"
    import torch

    return f"gradfuzz {mine} (torch {torch.__version__})"


SETUP_ERROR = ("2: a setup error (a bad flag, an --split-impl/--graphed-impl/--path that does not import, no ledger "
               "or corpus found): nothing was tested; the message names the fix.")
EXIT_FUZZ = ("exit status: 0: no divergence; 1: divergences found (each shrunk and saved); " + SETUP_ERROR
             + " A harness error also exits 2; Ctrl-C 130, SIGTERM 143.")
EXIT_REPLAY = ("exit status: 0: every divergence is a known bug its case expects on this torch (the summary counts known, "
               "new and fixed); 1: a new divergence; " + SETUP_ERROR)
EXIT_GATE = ("exit status: 0: PASSED, nothing untriaged (known, fixed, not reproduced, unavailable paths); 1: FAILED, "
             "a new divergence, a regression, a missed canary or a harness error (the report says which); "
             + SETUP_ERROR)


def _add_ledger_arg(p: argparse.ArgumentParser, what: str = "") -> None:
    from harness import project

    p.add_argument("--ledger", metavar="FILE", help=f"known-bug ledger{'; ' + what if what else ''} (default: "
                   f"cases/ledger.json of the installed gradfuzz project, {project.LEDGER}; none there: exit 2)")


def _add_fuzz_parsers(sub: Any, found_dir: str) -> None:
    """``fuzz`` and the commands that extend a fuzz session (``bench``, ``merge``)."""
    f = sub.add_parser("fuzz", help="generate cases and compare every path with eager autograd", epilog=EXIT_FUZZ)
    _add_path_args(f)
    f.add_argument("--json", metavar="FILE", help="write the full result as JSON")
    f.add_argument("--examples", type=int, help="examples per path (default 100)")
    f.add_argument("--minutes", type=float, help="total time budget, split over the paths")
    f.add_argument("--seed", type=int, help="the seed of the case stream (default: a fresh one, printed at the start; "
                   "the gate and selfcheck default to 0)")
    f.add_argument("--save", metavar="DIR", default=found_dir,
                   help=f"where shrunk failures go, outside the replayed corpus (default {found_dir})")
    f.add_argument("--mode", choices=("both", "exact", "tolerance"), default="both",
                   help="exact: small-integer data, any difference is a bug; tolerance: float data, nonlinear ops")
    _add_ledger_arg(f, "labels each finding known (with its bug) or not in ledger")
    from harness.cli import bench
    from harness.cli import fuzz as fuzz_command

    fuzz_command.add_arguments(f)
    f.set_defaults(func=cmd_fuzz)
    bench.add_parser(sub)
    fuzz_command.add_merge_parser(sub)


GATE_DIR = os.path.join(".gradfuzz", "gate")  # the gate's reports when no --json/--markdown names them


def _add_gate_parser(sub: Any, found_dir: str) -> None:
    g = sub.add_parser("gate", help="CI gate for framework upgrades: selfcheck, replay, fuzz, classify against the ledger",
                       epilog=EXIT_GATE)
    _add_path_args(g)
    g.add_argument("--json", metavar="FILE", default=os.path.join(GATE_DIR, "gate.json"),
                   help="the full gate record as JSON, every row (every other report renders from it; default "
                        f"{os.path.join(GATE_DIR, 'gate.json')}, under the directory the gate runs in)")
    budget = g.add_mutually_exclusive_group()
    budget.add_argument("--examples", type=int, help="examples per group of paths after the replay: the same verdict on any "
                        "machine, whatever its load (the form for CI)")
    budget.add_argument("--minutes", type=float, help="wall-clock fuzzing budget after the replay (local use; default 2 "
                        "when --examples is not given)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--corpus", nargs="*", help="corpus directories (default: cases/ of the installed gradfuzz project; "
                   "--corpus alone: none)")
    _add_ledger_arg(g)
    g.add_argument("--save", metavar="DIR", default=found_dir,
                   help=f"where new findings go, outside the replayed corpus (default {found_dir})")
    g.add_argument("--baseline", metavar="REPORT.json", help="a gate report from the previous torch: print what changed")
    g.add_argument("--junit", metavar="FILE", help="JUnit XML, one test case per path and source")
    g.add_argument("--markdown", metavar="FILE", default=os.path.join(GATE_DIR, "gate.md"),
                   help=f"Markdown summary (default {os.path.join(GATE_DIR, 'gate.md')}; also appended to "
                        "$GITHUB_STEP_SUMMARY)")
    g.add_argument("--html", metavar="FILE", help="self-contained HTML report with heatmaps and repro scripts")
    g.add_argument("-n", "--numprocesses", metavar="N|auto",
                   help="fuzz on N processes ('auto': one per core); each group of paths still draws the same cases, "
                        "so the verdict does not depend on N, only the wall time does")
    g.add_argument("--no-selfcheck", action="store_true", help="skip the canaries (not recommended)")
    g.add_argument("-v", "--verbose", action="store_true", help="one line per corpus case and path replayed")
    g.add_argument("--tolerance-slack", type=float, help=argparse.SUPPRESS)
    g.set_defaults(func=cmd_gate)


def _add_replay_parser(sub: Any) -> None:
    from harness.cli.fuzz import add_confirm_argument

    r = sub.add_parser("replay", help="replay corpus cases on every available path", epilog=EXIT_REPLAY)
    _add_path_args(r)
    r.add_argument("--json", metavar="FILE", help="write the full result as JSON")
    r.add_argument("targets", nargs="*", help="corpus files or directories (default: cases/ of the installed gradfuzz project)")
    r.add_argument("-v", "--verbose", action="store_true")
    r.add_argument("--migrate", action="store_true",
                   help="first rewrite corpus files of an older case schema in the current one (they load either way)")
    add_confirm_argument(r)
    r.set_defaults(func=cmd_replay)


def build_parser() -> argparse.ArgumentParser:
    from harness.artifacts.findings import DEFAULT_DIR as DEFAULT_FOUND

    parser = argparse.ArgumentParser(prog="gradfuzz", description="Differential gradient fuzzing for PyTorch machinery.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    _add_fuzz_parsers(sub, DEFAULT_FOUND)

    _add_replay_parser(sub)

    p = sub.add_parser("repro", help="re-run one corpus case and show the divergence")
    _add_path_args(p)
    p.add_argument("case")
    p.add_argument("--script", action="store_true", help="also print the standalone repro script")
    p.set_defaults(func=cmd_repro)

    _add_gate_parser(sub, DEFAULT_FOUND)
    from harness.cli import upstream, versions

    versions.add_parser(sub)
    upstream.add_parser(sub)

    sc = sub.add_parser("selfcheck", help="prove the harness still catches its canaries here")
    sc.add_argument("--seed", type=int, default=0)
    sc.add_argument("-n", "--numprocesses", metavar="N|auto", help="run N canaries at a time, each in a process of "
                    "its own ('auto': one per core); the results do not depend on N")
    sc.add_argument("--json", metavar="FILE", help="each canary's result as JSON")
    sc.add_argument("--canaries", metavar="NAME[,NAME]", help="run only these canaries (default: all; "
                    "an unknown name is a usage error that lists them)")
    sc.add_argument("--tolerance-slack", type=float,
                    help="loosen every comparison by this factor (to see selfcheck fail when detection is broken)")
    sc.set_defaults(func=cmd_selfcheck)

    t = sub.add_parser("table", help="one table from gate reports of several torch versions")
    t.add_argument("reports", nargs="+", metavar="REPORT.json")
    t.set_defaults(func=cmd_table)

    lg = sub.add_parser("ledger", help="replay every ledger entry's cases: signatures unrecorded, misfiled, or silent here")
    _add_path_args(lg)
    _add_ledger_arg(lg)
    lg.add_argument("--write", action="store_true", help="record unrecorded and misfiled signatures under the entries "
                    "whose cases show them")
    lg.add_argument("--rescheme", action="store_true", help="a ledger recorded under an older signature scheme: drop "
                    "its signatures and record this scheme's (with --write; then run `ledger --write` on every other "
                    "torch and machine the ledger covers)")
    lg.set_defaults(func=cmd_ledger)

    ps = sub.add_parser("paths", help="list the paths and whether each is available here")
    _add_path_args(ps)
    ps.set_defaults(func=cmd_paths)
    return parser


def _native_crashes_print_the_stack() -> None:
    """A SIGSEGV or SIGABRT in gradfuzz's own process (rank 0 under torchrun
    runs cases in-process) otherwise leaves no trace of where it was."""
    if faulthandler.is_enabled():  # pytest's, or the caller's own
        return
    try:
        faulthandler.enable(file=sys.__stderr__, all_threads=False)
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):  # no usable stderr: nothing to print to
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _native_crashes_print_the_stack()
    from harness.workers import pool

    if not pool.torchrun_env():
        return _run(args)
    if int(os.environ["RANK"]) != 0:
        # Under torchrun, ranks other than 0 follow rank 0's cases and exit when it is done.
        pool.leave_torchrun(pool.follow_torchrun(getattr(args, "backend", None)))
    pool.leave_torchrun(_run(args))


def entry() -> None:
    """The ``gradfuzz`` command: ``main``, ended without the interpreter's
    teardown of torch's modules (``zygote.end``: about a second of every
    command, once the families have imported dynamo)."""
    from harness.workers.zygote import end

    # Inductor compiles kernels in a pool of one process per core unless told
    # otherwise; with a compile child per flavour and per fuzz worker, -n 16
    # on 16 cores would start hundreds of them for graphs of a few kernels.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    end(lambda: sys.exit(main()))


def _run(args: argparse.Namespace) -> int:
    with escaped_output():  # names, titles and rows of strangers' files reach the terminal as text
        try:
            check_args(args)
            return args.func(args)
        except (UsageError, CorpusError, SpecError) as e:
            print(f"gradfuzz: error: {e}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    entry()
