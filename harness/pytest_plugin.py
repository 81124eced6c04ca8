"""The pytest plugin (entry point ``pytest11``): fuzz targets and corpus replay as test items.

Inert unless ``--gradfuzz-paths`` is given. Then it adds

- ``gradfuzz::fuzz[<paths>-shard<i>]``: one item per fuzz target (paths that
  share a case distribution) and shard; each shard has its own seed
  stream, so ``pytest -n auto`` spreads them over all cores. The item's
  ``obj`` is a plain Hypothesis test (``Target.plain_test``), so drivers of
  Hypothesis tests (HypoFuzz) can drive it; run by pytest, the item runs
  gradfuzz's rounds (every new signature found, shrunk, saved) and fails
  listing them;
- ``gradfuzz::replay[<path>::<corpus file>]``: every corpus case on every
  selected path (known bugs on this torch are xfail);
- ``gradfuzz::fuzz[<path>]`` / replay items for unavailable paths, skipped
  with the reason.

``gradfuzz fuzz -n N`` runs pytest-xdist with this plugin: workers write
status files into ``--gradfuzz-run-dir`` and stop when a ``stop`` file
appears there.
"""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any

import pytest

_session: Any = None  # this process's harness.engine.session.Session (one per xdist worker)
_paths_cache: dict[str, Any] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("gradfuzz", "gradient fuzzing (gradfuzz)")
    g.addoption("--gradfuzz-paths", metavar="NAMES", help="fuzz and replay these paths (names or families; 'all')")
    g.addoption("--gradfuzz-examples", type=int, metavar="N", help="examples per path over all shards (default 100)")
    g.addoption("--gradfuzz-minutes", type=float, metavar="M", help="wall-clock budget instead of --gradfuzz-examples")
    g.addoption("--gradfuzz-seed", type=int, default=0)
    g.addoption("--gradfuzz-shards", type=int, metavar="S",
                help="shards per fuzz target (default: the number of xdist workers, fewer for a target "
                     "of child paths on a small examples budget; else 1)")
    g.addoption("--gradfuzz-mode", choices=("both", "exact", "tolerance"), default="both")
    g.addoption("--gradfuzz-db", metavar="DIR|redis://HOST:PORT/N|none", default=None,
                help="Hypothesis example database (default .gradfuzz/examples)")
    g.addoption("--gradfuzz-save", metavar="DIR", default=".gradfuzz/found",
                help="where findings go, outside the replayed corpus (default .gradfuzz/found)")
    g.addoption("--gradfuzz-corpus", metavar="DIRS", default=None,
                help="comma-separated corpus files/dirs replayed as items (default: cases/ of the installed gradfuzz "
                     "project, if present; '' for none)")
    g.addoption("--gradfuzz-ledger", metavar="FILE", default=None,
                help="known-bug ledger that labels findings (default: cases/ledger.json of the installed gradfuzz "
                     "project; none there: a usage error)")
    g.addoption("--gradfuzz-settle-known", action="store_true",
                help="keep a first hit whose signatures the ledger places on its path as drawn, unshrunk "
                     "(the gate's fuzzing phase, as in one process)")
    g.addoption("--gradfuzz-coverage", choices=("measure", "guide"), default=None,
                help="trace the machinery each family tests: report its line coverage ('guide': and steer "
                     "Hypothesis towards new lines), as gradfuzz fuzz --coverage")
    g.addoption("--gradfuzz-run-dir", metavar="DIR", help=argparse_suppress())
    g.addoption("--gradfuzz-path", action="append", default=[], metavar="MODULE:ATTR",
                help="add a third-party path (repeatable)")
    g.addoption("--gradfuzz-option", action="append", default=[], metavar="NAME=VALUE",
                help="a path option, as gradfuzz fuzz takes them: split_impl=MODULE[:ATTR], world_size=2, ... (repeatable)")


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


def _options(config: pytest.Config) -> Any:
    from harness.paths import Options, UsageError

    from harness.paths import families

    known = {f.name: f for f in fields(Options) if f.name not in ("extra", "impls")}
    impl_options = {u.option for f in families() for u in f.user_impls}
    kw: dict[str, Any] = {"extra": tuple(config.getoption("gradfuzz_path") or ())}
    impls = []
    for item in config.getoption("gradfuzz_option") or ():
        name, _, value = item.partition("=")
        name = {"dtensor_backend": "backend"}.get(name.strip().replace("-", "_"), name.strip().replace("-", "_"))
        if name in impl_options:
            impls.append((name, value))
            continue
        if name not in known:
            raise UsageError(f"--gradfuzz-option {item!r}: unknown option; known: {', '.join(sorted(set(known) | impl_options))}")
        default = known[name].default
        kw[name] = type(default)(value) if isinstance(default, (int, float)) and not isinstance(default, bool) else value
    return Options(impls=tuple(impls), **kw)


def _selected(config: pytest.Config) -> list[Any]:
    from harness.paths import resolve

    spec = config.getoption("gradfuzz_paths")
    key = f"{spec}|{_options(config)}"
    if key not in _paths_cache:
        _paths_cache[key] = resolve(None if spec in ("all", "") else spec, _options(config))
    return _paths_cache[key]


def _workers() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gradfuzz: a gradfuzz fuzz target or corpus replay item")
    from harness.workers import lifeline

    lifeline.from_environment()  # under ``fuzz -n``: pytest and every worker end with the controller
    if config.getoption("gradfuzz_paths") is not None:
        _check_setup(config)


def _check_setup(config: pytest.Config) -> None:
    """Setup errors (no ledger, an unimportable split_impl, a bad
    --gradfuzz-path) stop the session before collection with the message
    and its fix; found later, they would read as skipped or unlabelled items."""
    from harness.paths import UsageError

    try:
        _ledger_file(config)
        _selected(config)
    except UsageError as e:
        raise pytest.UsageError(f"gradfuzz: {e}") from None


def _ledger_file(config: pytest.Config) -> str:
    from harness import project

    return project.ledger_file(config.getoption("gradfuzz_ledger"), flag="--gradfuzz-ledger")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("gradfuzz_paths") is None:
        return
    from harness.artifacts import corpus
    from harness.engine.session import plan

    paths = _selected(config)
    from harness.generate import MODES

    exact = MODES[config.getoption("gradfuzz_mode")]
    # --gradfuzz-shards is taken as given; the default (one per worker) is cut
    # for targets whose shards each start children (``shards_for``).
    shards = config.getoption("gradfuzz_shards")
    examples = None if shards else config.getoption("gradfuzz_examples")
    parent = GradfuzzCollector.from_parent(session, name="gradfuzz", nodeid="gradfuzz")
    live, dead = [], []
    for p in paths:
        a = p.availability()
        (live if a.ok else dead).append((p, a.reason))
    new: list[pytest.Item] = []
    targets = plan([p for p, _ in live], exact=exact, seed=config.getoption("gradfuzz_seed"),
                   shards=shards or _workers(), examples=examples)
    for t in targets:
        new.append(FuzzItem.from_parent(parent, name=f"fuzz[{t.name}-shard{t.shard}]", callobj=t.plain_test(),
                                        target=t, n_items=len(targets)))
    for p, why in dead:
        new.append(SkippedItem.from_parent(parent, name=f"fuzz[{p.name}]", reason=f"{p.name} unavailable here: {why}"))
    spec = config.getoption("gradfuzz_corpus")
    if spec is None:
        from harness import project

        spec = project.corpus_dirs()[0] if os.path.isdir(project.CORPUS) else ""
    files = corpus.discover([s for s in spec.split(",") if s]) if spec else []
    for f in files:
        for p, why in live + dead:
            name = f"replay[{p.name}::{os.path.relpath(f)}]"
            if why and not p.availability().ok:
                new.append(SkippedItem.from_parent(parent, name=name, reason=f"{p.name} unavailable here: {why}"))
            else:
                new.append(ReplayItem.from_parent(parent, name=name, file=f, path=p))
    for item in new:
        item.add_marker(pytest.mark.gradfuzz)
    items.extend(new)


class GradfuzzCollector(pytest.Collector):
    def collect(self) -> list[pytest.Item]:  # items are made in pytest_collection_modifyitems
        return []


def _worker_session(config: pytest.Config) -> Any:
    global _session
    if _session is None:
        from harness.engine.database import open_database
        from harness.engine.session import Session, _single_thread
        from harness.engine.target import Stop

        run_dir = config.getoption("gradfuzz_run_dir")
        stop = Stop(os.path.join(run_dir, "stop") if run_dir else None)
        db = config.getoption("gradfuzz_db")
        from harness.gate.ledger import labeller, load, settled_by

        settled = None
        if config.getoption("gradfuzz_settle_known"):
            import torch

            settled = settled_by(load(_ledger_file(config)), torch.__version__)
        _session = Session(save_dir=config.getoption("gradfuzz_save") or None, db_spec=db, database=open_database(db),
                           label=labeller(_ledger_file(config)), settled=settled,
                           stop=stop, seed=config.getoption("gradfuzz_seed"),
                           worker=os.environ.get("PYTEST_XDIST_WORKER", "main"),
                           coverage=config.getoption("gradfuzz_coverage"))
        _session.set_budget(config.getoption("gradfuzz_examples"), config.getoption("gradfuzz_minutes"))
        _single_thread()
    return _session


def _write_status(config: pytest.Config) -> None:
    run_dir = config.getoption("gradfuzz_run_dir")
    if run_dir and _session is not None:
        from harness.engine.session import write_status

        write_status(os.path.join(run_dir, f"status-{_session.worker}.json"), _session.snapshot())


class FuzzItem(pytest.Function):
    def __init__(self, *, target: Any, n_items: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.target = target
        self.n_items = n_items
        self.add_marker(pytest.mark.hypothesis)

    def runtest(self) -> None:
        config = self.config
        session = _worker_session(config)
        examples = session.examples_budget
        minutes = config.getoption("gradfuzz_minutes")
        # Items share the wall clock: each worker runs n_items / workers of them in turn.
        deadline = session.slice(minutes * 60 * max(1, _workers()) / max(1, self.n_items)) if minutes is not None else None
        # The budget over all shards, as --gradfuzz-examples says: 20 over 16 shards is 2 for
        # four and 1 for twelve (rounding each up ran 32, the compile target's cases with it).
        n = self.target.shards
        per_shard = examples // n + (self.target.shard < examples % n) if examples is not None else None
        run = session.run_target(self.target, examples=per_shard, deadline=deadline,
                                 heartbeat=lambda: _write_status(config))
        _write_status(config)
        errors = [e for e in session.result.errors if self.target.name in e]
        if errors:
            raise RuntimeError("; ".join(errors))
        if run.findings:
            lines = [f"{len(run.findings)} divergence signature(s) not seen earlier in this session on {self.target.name}:"]
            for f in run.findings:
                d = f.divergences[0]
                where = session.details.get(d.signature, {}).get("file")
                known = session.details.get(d.signature, {}).get("ledger", "")
                lines.append(f"  {f.path.name} {d.kind} [{d.signature}] ({known}){' FLAKY' if f.flaky else ''}: {d.detail}")
                if where:
                    lines.append(f"      reproduce: gradfuzz repro {where}")
            raise FuzzFailure("\n".join(lines))

    def repr_failure(self, excinfo: Any, style: Any = None) -> Any:  # type: ignore[override]
        if isinstance(excinfo.value, FuzzFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"gradfuzz {self.name}"


class FuzzFailure(AssertionError):
    pass


class ReplayItem(pytest.Item):
    def __init__(self, *, file: str, path: Any, **kw: Any) -> None:
        super().__init__(**kw)
        self.file = file
        self.gpath = path

    def runtest(self) -> None:
        import torch

        from harness.artifacts import corpus
        from harness.case import opinfo
        from harness.engine.runner import check

        entry = corpus.load(self.file)
        if here := opinfo.unavailable(entry.case.nodes):
            pytest.skip(f"not runnable on torch {torch.__version__}: {here}")
        reason = self.gpath.supports(entry.case)
        if reason is not None:
            pytest.skip(f"outside {self.gpath.name}'s contract: {reason}")
        divs = check(entry.case, self.gpath)
        if divs and entry.expected_on(self.gpath.name, torch.__version__):
            pytest.xfail(f"known bug on torch {torch.__version__}: {divs[0].detail}")
        if divs:
            raise FuzzFailure("\n".join(f"{d.kind} [{d.signature}] {d.detail}" for d in divs)
                              + f"\n  reproduce: gradfuzz repro {self.file} --paths {self.gpath.name}")

    def repr_failure(self, excinfo: Any, style: Any = None) -> Any:  # type: ignore[override]
        if isinstance(excinfo.value, FuzzFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.file, None, f"gradfuzz {self.name}"


class SkippedItem(pytest.Item):
    def __init__(self, *, reason: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.reason = reason

    def runtest(self) -> None:
        pytest.skip(self.reason)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"gradfuzz {self.name}"


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's load scheduling starts a worker only once it holds two items
    (the running one needs its successor), and hands out consecutive or
    round-robin items: the second item of the worker that got the heaviest
    target waited behind it (on 16 workers split.fixed started minutes
    into the gate's fuzzing, queued behind a compile flavour). Ours
    starts each worker on one of the first items (heaviest first) with one of
    the last queued behind it (``first_round``), then hands out one item at
    a time as a worker's queue runs low: ``load`` refilled a queue with up
    to half of a worker's share at once, so one worker queued the compile
    flavours one behind the other while the other ran out of work."""
    if config.getoption("gradfuzz_paths") is None or config.getvalue("dist") != "load":
        return None
    return _shard_scheduling()(config, log)


def first_round(n: int, workers: int) -> tuple[list[list[int]], list[int]]:
    """The items each worker starts with, and those left pending, in order.
    Worker i gets item i of the first ``workers`` (heaviest first) and,
    where there are more items, one of the last ones: the heaviest of them
    behind the lightest of the first."""
    heads = list(range(min(n, workers)))
    k = min(len(heads), n - len(heads))
    tails = list(range(n - k, n))
    rounds = [[h] + ([tails[len(heads) - 1 - i]] if len(heads) - 1 - i < k else []) for i, h in enumerate(heads)]
    return rounds, list(range(len(heads), n - k))


def _shard_scheduling() -> Any:
    from xdist.scheduler import LoadScheduling

    class ShardScheduling(LoadScheduling):
        def schedule(self) -> None:
            if self.collection is None and self.collection_is_completed and self._check_nodes_have_same_collection():
                self.collection = next(iter(self.node2collection.values()))
                n = len(self.collection)
                if self.maxschedchunk is None:
                    self.maxschedchunk = 1
                rounds, self.pending[:] = first_round(n, len(self.nodes))
                for node, items in zip(self.nodes, rounds):
                    self.pending[:0] = items
                    self._send_tests(node, len(items))
                if not self.pending:
                    for node in self.nodes:
                        node.shutdown()
                return
            super().schedule()

    return ShardScheduling


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _session is not None:
        _session.done = True
        _write_status(session.config)
    from harness.engine.runner import close_paths

    for paths in _paths_cache.values():
        close_paths(paths)
