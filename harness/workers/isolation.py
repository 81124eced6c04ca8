"""Crash isolation: a path that can take its process down runs in a child.

A graph wrapper that reads freed memory can segfault, or leave the CUDA
context broken (a sticky illegal-address error) so that every later case
fails too. ``IsolatedPath`` runs such a path in a persistent child process
(``python -m harness.workers.isolation``): the child builds the path once, runs
cases one at a time and is restarted after any crash, hang or broken
device. A crash is a finding (a ``Violation`` of kind "crash", with the
signal and the tail of the child's log); the session goes on.

The parent side never imports the path's machinery: it builds a local copy
of the path from the same recipe for the cheap parts (name, contract,
supports, availability, repro source) and sends cases to the child.

Protocol, on the child's stdin and on a duplicate of its original stdout
(its fd 1 is pointed at its log, so stray prints cannot corrupt it): 8-byte
big-endian length, then a pickle. Parent sends ``("run", case_json,
path_name, workarounds)`` (``path_name`` None, or the path of a child
serving several; ``workarounds`` those in force in the parent, in force in
the child for that case) or ``("close",)``; the child answers ``("ready",)`` once and then
``("obs", Observation, healthy)`` per case.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

from harness.machinery_coverage import attach, child_tracer
from harness.materialize import workarounds
from harness.materialize.lifetime import FrozenHeap
from harness.objects import load_object
from harness.observation import Observation, Violation
from harness.case.spec import Case
from harness.workers import trace, zygote
from harness.workers.wire import dumps
from harness.workers.interpreter import one_thread_env
from harness.workers.placement import one_gpu_env

PROGRESS_ENV = "GRADFUZZ_WORKER_PROGRESS"
STARTUP_TIMEOUT = 180.0
_MARK = "gradfuzz-worker: backward "


def progress(k: int) -> None:
    """Paths call this at the start of backward ``k``: a crash report then names it."""
    if os.environ.get(PROGRESS_ENV):
        sys.stderr.write(f"{_MARK}{k}\n")
        sys.stderr.flush()


# Child processes a family may keep busy at once with one case's paths
# (``IsolatedPath.submit``; the compile flavours). Corpus replay sets 1: it
# runs cases in order and shares its work out by cases instead.
OVERLAP_ENV = "GRADFUZZ_OVERLAP_PROCS"


def overlap_procs(most: int) -> int:
    """``most`` at most; by default half the cores this process's share of the
    host has (the rest are for the other fuzz targets): the cores over the
    run's fuzz workers (``-n``), so a 2-core host keeps one child, and so
    does each of 16 workers on 16 cores (with 7 each, 112 compile children
    shared 16 cores)."""
    raw = os.environ.get(OVERLAP_ENV, "")
    if raw.isdigit() and int(raw) > 0:
        return min(int(raw), most)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")
    share = cores // max(int(workers) if workers.isdigit() else 1, 1)
    return max(1, min(most, share // 2))


def build(recipe: tuple[str, dict[str, Any]]) -> Any:
    """``("module:factory", kwargs)`` -> the path object."""
    spec, kwargs = recipe
    return load_object(spec, "isolated path factory", require_attr=True)(**kwargs)


class IsolatedPath:
    """A path whose ``run`` happens in a persistent, restartable child."""

    def __init__(self, recipe: tuple[str, dict[str, Any]], timeout: float = 60.0) -> None:
        self.recipe = recipe
        self.local = build(recipe)
        self.name = self.local.name
        self.contract = self.local.contract
        self.timeout = timeout
        self._proc: subprocess.Popen | None = None
        self._log: Any = None
        self._out: Any = None
        self.starts = 0  # children started; every one after the first replaced a crashed, hung or broken one
        self._ahead: tuple[Case, str | None, float] | None = None  # (case, path name, sent at): submitted, not read
        self._booting = False  # spawned by start_soon, its "ready" not read yet

    def availability(self):
        return self.local.availability()

    @property
    def workarounds(self) -> tuple[str, ...]:
        """The outside workarounds the path applies where it runs: each case's
        message carries those in force, and the child runs it inside them."""
        return tuple(getattr(self.local, "workarounds", ()))

    def supports(self, case: Case) -> str | None:
        return self.local.supports(case)

    def repro(self, case: Case):
        return self.local.repro(case)

    # --- the child -------------------------------------------------------

    @property
    def restarts(self) -> int:
        return max(self.starts - 1, 0)

    def start_soon(self) -> None:
        """Start the child and return without waiting for it to be ready: a
        caller about to use several isolated paths one after another (the
        gate's workaround checks) lets their interpreter starts overlap."""
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._spawn()

    def _spawn(self) -> None:
        self.starts += 1
        self._log = tempfile.TemporaryFile(prefix="gradfuzz-worker-")
        env = {**os.environ, PROGRESS_ENV: "1", **one_gpu_env(), **one_thread_env()}
        self._proc = zygote.start("harness.workers.isolation", [],  # forked warm, or a fresh interpreter
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env)
        self._send(("init", self.recipe))
        self._booting = True

    def _await_ready(self) -> None:
        self._booting = False
        t0 = time.monotonic()
        reply = self._recv(STARTUP_TIMEOUT)
        trace.record("start", "child", self.name, "ready" if isinstance(reply, tuple) else str(reply),
                     time.monotonic() - t0, "waited for (the start may have overlapped other work)")
        if not (isinstance(reply, tuple) and reply[:1] == ("ready",)):
            detail = self._log_tail()
            self._kill()
            raise RuntimeError(f"{self.name}: the worker process did not start: {reply!r}\n{detail}")

    def _send(self, msg: Any) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        data = pickle.dumps(msg)
        self._proc.stdin.write(struct.pack(">Q", len(data)) + data)
        self._proc.stdin.flush()

    def _recv(self, timeout: float) -> Any:
        """The next message; None if the child died, "timeout" if it took too long."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        buf = b""
        need = 8
        size = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(fd, need - len(buf))
            if not chunk:
                return None
            buf += chunk
            if len(buf) < need:
                continue
            if size is None:
                size = struct.unpack(">Q", buf)[0]
                buf, need = b"", size
                if size == 0:
                    return pickle.loads(b"")
                continue
            return pickle.loads(buf)

    def _log_tail(self, chars: int = 1500) -> str:
        if self._log is None:
            return ""
        try:
            self._log.flush()
            self._log.seek(0, os.SEEK_END)
            size = self._log.tell()
            self._log.seek(max(0, size - 20000))
            text = self._log.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""
        return text[-chars:]

    def _last_backward(self) -> int:
        k = -1
        for line in self._log_tail(20000).splitlines():
            if line.startswith(_MARK):
                try:
                    k = int(line[len(_MARK):])
                except ValueError:
                    pass
        return k

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        self._ahead, self._booting = None, False
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                try:
                    if f is not None:
                        f.close()
                except OSError:
                    pass
        if self._log is not None:
            self._log.close()
            self._log = None

    # --- the path protocol ------------------------------------------------

    def _message(self, case: Case, path_name: str | None = None) -> tuple:
        """What the child gets for one case: a child serving several paths (the
        compile flavours share one) also gets the path's name; the outside
        workarounds in force here go with it."""
        return ("run", case.dumps(), path_name, workarounds.in_force_now())

    def submit(self, case: Case, path_name: str | None = None) -> None:
        """Start ``case`` in the child and return at once; ``run`` with the
        same case object collects it. A caller holding several isolated
        paths keeps their children busy side by side (the compile flavours
        on a many-core host) and still reads the results in its own order,
        so what it concludes does not depend on how many ran at once."""
        self._drain()
        self._ensure_child()
        self._log_mark()
        try:
            self._send(self._message(case))
        except (BrokenPipeError, OSError):
            return  # ``run`` finds the dead child and reports it
        self._ahead = (case, path_name, time.monotonic())

    def pending(self) -> bool:
        return self._ahead is not None

    def _drain(self) -> None:
        """Read and drop a submitted case's result nobody asked for (the
        caller stopped at an earlier path's divergence): the child must be
        idle before it is sent the next case."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and self._proc is not None:
            reply = self._recv(self._left(ahead))
            if not (isinstance(reply, tuple) and reply[:1] == ("obs",) and reply[2]):
                self._kill()

    def _ensure_child(self) -> None:
        self.start_soon()
        if self._booting:  # started just now, or earlier by start_soon: its "ready" is still to be read
            self._await_ready()

    def _left(self, ahead: tuple[Case, str | None, float]) -> float:
        """What is left of the timeout of a case sent at ``ahead[2]``."""
        return max(self.timeout - (time.monotonic() - ahead[2]), 0.001)

    def run(self, case: Case, path_name: str | None = None) -> Observation:
        ahead = self._ahead
        if ahead is None or ahead[0] is not case or ahead[1] != path_name:
            self.submit(case, path_name)  # not submitted ahead: sent now (what was pending is drained first)
        ahead, self._ahead = self._ahead, None
        try:
            reply = self._recv(self._left(ahead)) if ahead is not None else None  # None: the send failed
        except (BrokenPipeError, OSError):
            reply = None
        if ahead is not None:
            trace.record("case", "child", ahead[1] or self.name, "obs" if isinstance(reply, tuple) else str(reply),
                         time.monotonic() - ahead[2], f"starts {self.starts}")
        return self._reply(reply)

    def _reply(self, reply: Any) -> Observation:
        if isinstance(reply, tuple) and reply[:1] == ("obs",):
            _, obs, healthy = reply
            if not healthy:
                self._kill()  # a broken device context: the next case gets a fresh child
            return obs
        obs = Observation(path=self.name)
        k = self._last_backward()
        tail = self._log_tail()
        if reply == "timeout":
            self._kill()
            obs.violations.append(Violation(
                "timeout", k, "process",
                f"no result after {self.timeout:g}s (last started backward {k}); the worker was killed and restarted",
                key="timeout"))
            return obs
        code = self._proc.wait() if self._proc is not None else None
        how = _describe_exit(code)
        self._kill()
        obs.violations.append(Violation(
            "crash", k, "process",
            f"the worker process died ({how}) during backward {k}; the session goes on with a fresh worker"
            + (f". Last output: {_squash(tail)}" if tail.strip() else ""),
            key=f"crash {how}"))
        return obs

    def _log_mark(self) -> None:
        """Keep per-case log tails apart (and the log from growing without bound)."""
        if self._log is not None:
            try:
                self._log.seek(0)
                self._log.truncate()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._send(("close",))
                self._proc.wait(timeout=10)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
        self._kill()

    def __del__(self) -> None:  # a forgotten close() must not leave a child behind
        try:
            self._kill()
        except Exception:
            pass


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _squash(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(_MARK)]
    return " | ".join(lines[-6:])[-600:]


# --- the child's side ------------------------------------------------------


def _read_exact(f: Any, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _device_healthy(path: Any) -> tuple[bool, str]:
    from harness.workers.gpu import device_error

    error = device_error(getattr(path, "device", "cpu"))
    return error is None, error or ""


def worker() -> int:
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints from the machinery go to the log, not into the protocol
    sys.stdout = sys.stderr

    def send(msg: Any) -> None:
        data = dumps(msg)
        out.write(struct.pack(">Q", len(data)) + data)
        out.flush()

    path = None
    heap: FrozenHeap | None = None  # from the end of the first case on
    while True:
        head = _read_exact(inp, 8)
        if head is None:
            return 0
        body = _read_exact(inp, struct.unpack(">Q", head)[0])
        if body is None:
            return 0
        msg = pickle.loads(body)
        if msg[0] == "init":
            path = build(msg[1])
            send(("ready",))
        elif msg[0] == "run":
            assert path is not None
            case = Case.loads(msg[1])
            tracer = child_tracer()  # --coverage: the machinery lines this case reached go back with it
            with workarounds.in_force(*msg[3]), tracer if tracer is not None else contextlib.nullcontext():
                obs = path.run(case) if msg[2] is None else path.run_on(msg[2], case)
            if tracer is not None:
                attach(obs.extra, tracer)
            healthy, why = _device_healthy(path)
            if not healthy:
                k = obs.steps[-1].k if obs.steps else -1
                obs.violations.append(Violation(
                    "crash", k, "device",
                    f"the device was unusable after the case ({why}); the worker was restarted",
                    key="crash device context"))
            send(("obs", obs, healthy))
            if not healthy:
                return 0
            # Freeze what survives each case (``FrozenHeap``), so the full collections of
            # allocator-pressure events walk only what the next case makes: after the first,
            # every lazy initialisation (CUDA context, cuBLAS, compiled kernels' modules; 54 ms
            # a collection, most of graphed.fixed's time on a GPU), after each later one what
            # it compiled (dynamo's graphs and guards of a new structure: two thirds of a
            # compile flavour's time on cases of a compiled structure).
            if heap is None:
                heap = FrozenHeap().__enter__()
            else:
                heap.between_cases()
        elif msg[0] == "close":
            return 0


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", message=".*NumPy.*")
    sys.exit(worker())
