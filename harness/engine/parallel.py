"""``gradfuzz fuzz -n N``: the controller of a pytest-xdist session.

The fuzz targets run as pytest items (``harness.pytest_plugin``) on N xdist
workers; this process only starts pytest, shows progress from the workers'
status files, and turns Ctrl-C into a ``stop`` file that the workers honour
between examples. pytest runs in its own process group, so a terminal's
Ctrl-C reaches only us; a second Ctrl-C (or workers that do not stop within
``grace`` seconds) ends the group.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib.metadata import entry_points
from typing import Any

from harness.engine.session import combine, read_statuses
from harness.workers import lifeline

RUNS_DIR = os.path.join(".gradfuzz", "runs")
TERM_GRACE = 2.0  # seconds workers get after SIGTERM (CI cancels, ``timeout``) before the group is killed


def _plugin_args() -> list[str]:
    """Load the plugin explicitly only where its entry point is not installed."""
    installed = any(ep.value == "harness.pytest_plugin" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "harness.pytest_plugin"]


def pytest_command(run_dir: str, *, workers: str, paths: str | None, examples: int | None, minutes: float | None,
                   seed: int, mode: str, db: str | None, save: str | None, shards: int | None,
                   options: dict[str, Any], extra_paths: list[str], ledger: str | None = None,
                   coverage: str | None = None, settle_known: bool = False) -> list[str]:
    ini = os.path.join(run_dir, "pytest.ini")
    with open(ini, "w") as fh:
        fh.write("[pytest]\n")  # not the project's ini: no testpaths, addopts or markers of someone else's
    cmd = [sys.executable, "-m", "pytest", "-c", ini, "--rootdir", run_dir, "-p", "no:cacheprovider",
           "-q", "-n", workers, *_plugin_args(),
           "--gradfuzz-paths", paths or "all", "--gradfuzz-seed", str(seed), "--gradfuzz-mode", mode,
           "--gradfuzz-run-dir", run_dir, "--gradfuzz-corpus", "",
           "--gradfuzz-save", os.path.abspath(save) if save else ""]
    if db is not None:
        cmd += ["--gradfuzz-db", _absolute_db(db)]
    if examples is not None:
        cmd += ["--gradfuzz-examples", str(examples)]
    if minutes is not None:
        cmd += ["--gradfuzz-minutes", str(minutes)]
    if shards is not None:
        cmd += ["--gradfuzz-shards", str(shards)]
    for name, value in options.items():
        cmd += ["--gradfuzz-option", f"{name}={value}"]
    for p in extra_paths:
        cmd += ["--gradfuzz-path", p]
    if coverage is not None:
        cmd += ["--gradfuzz-coverage", coverage]
    if settle_known:
        cmd.append("--gradfuzz-settle-known")
    if ledger is not None:  # the workers' cwd is the caller's: an absolute path survives any change of it
        cmd += ["--gradfuzz-ledger", os.path.abspath(ledger)]
    cmd.append(run_dir)
    return cmd


class Controller:
    """Starts the xdist session and reads its workers' state."""

    def __init__(self, cmd: list[str], run_dir: str, workers: str, grace: float = 30.0) -> None:
        self.cmd = cmd
        self.run_dir = run_dir
        self.workers = workers
        self.grace = grace
        self.started = time.time()
        self.stopping = False
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = os.path.join(run_dir, "pytest.log")
        self.unavailable: dict[str, str] = {}  # known to the caller; workers only skip them

    def start(self) -> "Controller":
        env = dict(os.environ)
        env.setdefault("PYTHONWARNINGS", "ignore::UserWarning")
        env[lifeline.ENV] = str(os.getpid())  # pytest and its workers watch us: no orphans if we are killed
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=env,
                                         preexec_fn=lifeline.set_parent_death_signal)
        return self

    def view(self) -> dict[str, Any]:
        snaps = read_statuses(self.run_dir)
        result, extra = combine(snaps)
        deadline = next((s["deadline"] for s in snaps if s.get("deadline")), None)
        budget = next((s["examples_budget"] for s in snaps if s.get("examples_budget")), None)
        paths = {n: {"examples": t.examples, "run": t.run, "skipped": t.skipped, "seconds": t.seconds,
                     "per_example": t.per_example, "finished": t.finished}
                 for n, t in result.paths.items()}
        return {"started": self.started, "deadline": deadline, "examples_budget": budget, "paths": paths,
                "unavailable": {**self.unavailable, **result.unavailable}, "counts": extra["counts"], "details": extra["details"],
                "saved": result.saved, "errors": result.errors, "workers": max(len(snaps), 1),
                "from_status": True}

    def request_stop(self, grace: float | None = None) -> None:
        """Ask the workers to stop between examples; end the group after
        ``grace`` seconds (default: ``self.grace``). A second request ends it now."""
        if grace is not None:
            self.grace = min(self.grace, grace)
        if not self.stopping:
            self.stopping = True
            open(os.path.join(self.run_dir, "stop"), "w").close()
        else:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self) -> int:
        assert self.proc is not None
        stop_seen: float | None = None
        while True:
            try:
                rc = self.proc.wait(timeout=0.2)
                return rc
            except subprocess.TimeoutExpired:
                pass
            if self.stopping:
                stop_seen = stop_seen or time.monotonic()
                if time.monotonic() - stop_seen > self.grace:
                    self.kill()

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log, errors="replace") as fh:
                return "".join(fh.readlines()[-n:])
        except OSError:
            return ""


def _absolute_db(db: str) -> str:
    """A directory database by its absolute path (``none``, ``redis://...`` and the default as given)."""
    return db if not db or "://" in db or db.lower() == "none" else os.path.abspath(db)


def new_run_dir() -> str:
    """This session's folder for the workers' status files and the stop file.
    Absolute, as are the findings folder and a directory database on the
    workers' command line: what several processes share never depends on
    the working directory each of them happens to have."""
    os.makedirs(RUNS_DIR, exist_ok=True)
    return os.path.abspath(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=RUNS_DIR))


def cleanup(run_dir: str, keep: bool) -> None:
    if not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
