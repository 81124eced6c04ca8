"""Warm starts: the harness's children forked from a process that has
already imported torch.

Every child the harness starts (a compile flavour's worker, a canary of
the gate's self-check, a replay process) was a fresh interpreter that spent
its first seconds importing: torch about 0.9 s on a 2-core host, the
harness 0.2 s, dynamo and Inductor 1.5 s more before a compile flavour's
first case. A gate starts dozens of them. The zygote pays that once per
process that starts children: it is itself such a child (``python -I``,
the parent's import path, nothing from the working directory), imports
``PRELOAD`` and then forks one child per request. The child is the fresh
process it replaces in what it can see: its own stdin, stdout and stderr
(passed over a Unix socket), environment, working directory, import path
and argv, and the module run as ``__main__``; it ends as a normal exit does
(threads joined, ``atexit``, streams flushed) but skips the teardown of
torch's modules (``_finish``). The zygote reports each child's pid and exit
status (a signal as a negative number, as ``subprocess`` does), so a crash
reads the same.

A child cannot differ from a fresh process through what the zygote
imported: the zygote runs no torch op, starts no thread and no CUDA
context (a probe child checks that CUDA is not poisoned for forks, and the
kernel must count one thread, before the first real one), and a request
whose environment differs from the zygote's in a variable that torch or the
interpreter read at import falls back to a fresh interpreter
(``import_time_env``). ``GRADFUZZ_WARM_START=0`` turns it all off (the
benchmark compares both). Linux only: it needs fork and ``SCM_RIGHTS``;
elsewhere every child is a fresh interpreter.

Children die with the zygote (``PR_SET_PDEATHSIG``) and the zygote with
the socket to its parent, so nothing outlives a killed gate.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import IO, Any, Callable, NoReturn

from harness.workers import lifeline
from harness.workers.interpreter import import_path, python

ENV = "GRADFUZZ_WARM_START"
# What the children it forks import first: the CLI (canaries), the replay
# process, a compile flavour's worker, and the torch parts the families use.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.pipelining", "torch.distributed.tensor", "harness.cli.main",
           "harness.engine.replay_pool", "harness.workers.isolation", "harness.paths.compile.paths")
# Only where torch has no CUDA: on a CUDA build importing Inductor asks the
# driver for devices, which starts a driver thread and poisons CUDA for every
# forked child ("Cannot re-initialize CUDA in forked subprocess", seen on torch 2.11).
PRELOAD_WITHOUT_CUDA = ("torch._inductor.compile_fx",)
# Read at run time, not at import: a child may differ from the zygote in these.
RUN_TIME_PREFIXES = ("GRADFUZZ_", "PYTEST_", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MASTER_", "RANK", "WORLD_SIZE",
                     "LOCAL_RANK", "NCCL_", "GLOO_", "PYTHONFAULTHANDLER")
MAX_MESSAGE = 1 << 20
START_TIMEOUT = 120.0


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    """The part of an environment that a child reads before it runs our code
    (torch's and the interpreter's settings): a warm child must match it."""
    return {k: v for k, v in env.items() if not k.startswith(RUN_TIME_PREFIXES)}


def enabled() -> bool:
    return (sys.platform.startswith("linux") and hasattr(socket, "send_fds")
            and os.environ.get(ENV, "1") != "0")


# --- the parent's side -------------------------------------------------------


class Child:
    """A forked child, read like ``subprocess.Popen`` (what the harness uses of it)."""

    def __init__(self, zygote: "Zygote", pid: int, args: list[str], stdin: IO[bytes] | None,
                 stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.zygote, self.pid, self.args = zygote, pid, args
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.status(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.status(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The parent's handle on its zygote process (one per process, ``shared``)."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.import_env = import_time_env(self.env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.proc = subprocess.Popen(python("harness.workers.zygote", str(theirs.fileno())), pass_fds=[theirs.fileno()],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=self.env)
        theirs.close()
        self.lock = threading.Lock()
        self.exits: dict[int, int] = {}
        self.started: dict[int, int] = {}
        self.failed: set[int] = set()  # requests the zygote could not fork (the caller starts a fresh one)
        self.children: set[int] = set()
        self.owner = os.getpid()  # a process forked from ours (a pool's rank) starts its own
        self.alive = True
        self.ready: bool | None = None  # None: its "ready" (or refusal) not read yet
        self.next_id = 0

    def usable(self, env: dict[str, str]) -> bool:
        if self.ready is None:
            self._pump_until(lambda: self.ready is not None, START_TIMEOUT)
        return bool(self.alive and self.ready and import_time_env(env) == self.import_env)

    def spawn(self, module: str, args: list[str], fds: tuple[int, int, int], env: dict[str, str]) -> int | None:
        """Fork a child running ``module`` as ``__main__``; its pid, or None if
        the zygote could not (the caller starts a fresh interpreter)."""
        with self.lock:
            self.next_id += 1
            rid = self.next_id
            msg = json.dumps({"id": rid, "module": module, "args": args, "env": env, "cwd": os.getcwd(),
                              "path": import_path()}).encode()
            if len(msg) > MAX_MESSAGE // 16:  # past a socket buffer (a huge environment): a fresh interpreter
                return None
            try:
                socket.send_fds(self.sock, [msg], list(fds))
            except OSError:
                self._dead()
                return None
        self._pump_until(lambda: rid in self.started or rid in self.failed, START_TIMEOUT)
        self.failed.discard(rid)
        return self.started.pop(rid, None)

    def status(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit status once it has ended, waiting up to ``timeout`` (None: for ever)."""
        self._pump_until(lambda: pid in self.exits, timeout)
        return self.exits.pop(pid, None)  # read once: the Child keeps it

    def _pump_until(self, done, timeout: float | None) -> None:
        """Read the zygote's messages until ``done()`` or ``timeout`` (0: only what has come)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self.lock:
                while self.alive and select.select([self.sock], [], [], 0)[0]:
                    self._read_one()
                if done() or not self.alive:
                    return
                left = 1.0 if deadline is None else min(deadline - time.monotonic(), 1.0)
                if left <= 0:
                    return
                if select.select([self.sock], [], [], left)[0]:
                    self._read_one()

    def _read_one(self) -> None:
        try:
            data = self.sock.recv(MAX_MESSAGE)
        except OSError:
            data = b""
        if not data:
            self._dead()
            return
        msg = json.loads(data)
        if "exit" in msg:
            self.exits[msg["exit"]] = msg["status"]
            self.children.discard(msg["exit"])
        elif "started" in msg:
            self.started[msg["started"]] = msg["pid"]
            self.children.add(msg["pid"])
            self.exits.pop(msg["pid"], None)  # a reused pid's old status
        elif "failed" in msg:
            self.failed.add(msg["failed"])
        elif "ready" in msg:
            self.ready = bool(msg["ready"])

    def _dead(self) -> None:
        """The zygote is gone, and with it (``PR_SET_PDEATHSIG``) every child it forked."""
        if self.alive:
            self.alive = False
            self.ready = self.ready or False
            for pid in self.children:
                self.exits.setdefault(pid, -signal.SIGKILL)

    def close(self) -> None:
        self.alive = False
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_shared: Zygote | None = None
_shared_lock = threading.Lock()


def shared() -> Zygote | None:
    """This process's zygote, started on first use; None where warm starts are off."""
    global _shared
    if not enabled():
        return None
    with _shared_lock:
        # A zygote that refused (CUDA poisoned, a thread) or died booting is not
        # tried again in this process: each try costs its imports. One that
        # worked and was killed since is replaced.
        if _shared is None or _shared.owner != os.getpid() or (not _shared.alive and _shared.ready):
            try:
                _shared = Zygote()
            except OSError:
                return None
    return _shared


def _fd(spec: Any, which: int) -> tuple[int, Any]:
    """A Popen-style argument for stream ``which`` (0, 1, 2) as (fd for the
    child, what the parent keeps)."""
    if spec is subprocess.PIPE:
        r, w = os.pipe()
        return (r, os.fdopen(w, "wb")) if which == 0 else (w, os.fdopen(r, "rb"))
    if spec is None:
        return os.dup(which), None
    if spec is subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), None
    if isinstance(spec, int):
        return os.dup(spec), None
    return os.dup(spec.fileno()), None


def start(module: str, args: list[str], *, stdin: Any = None, stdout: Any = None, stderr: Any = None,
          env: dict[str, str] | None = None) -> Any:
    """``module`` run as ``__main__`` in a child (``subprocess.Popen``'s stream
    arguments: PIPE, DEVNULL, a file, or ``subprocess.STDOUT`` for stderr):
    forked from this process's zygote where it can be, else a fresh
    interpreter (``interpreter.python``). Either way a Popen-like object."""
    env = dict(os.environ if env is None else env)
    z = shared()
    if z is not None and z.usable(env):
        opened: list[int] = []
        kept: list[Any] = []
        try:
            for which, spec in enumerate((stdin, stdout, stderr)):
                if which == 2 and spec is subprocess.STDOUT:
                    fd, keep = os.dup(opened[1]), None
                else:
                    fd, keep = _fd(spec, which)
                opened.append(fd)
                kept.append(keep)
            pid = z.spawn(module, args, (opened[0], opened[1], opened[2]), env)
        finally:
            for fd in opened:
                os.close(fd)
        if pid is not None:
            return Child(z, pid, [module, *args], *kept)
        for f in kept:
            if f is not None:
                f.close()
    return subprocess.Popen(python(module, *args), stdin=stdin, stdout=stdout, stderr=stderr, env=env)


# --- the zygote's side -------------------------------------------------------


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.send(json.dumps(msg).encode())


def _preload() -> bool:
    """Import ``PRELOAD``; False if forking is unsafe afterwards (an import
    started a thread, Python's or the CUDA driver's, or poisoned CUDA for
    forks): then no child is forked."""
    import torch

    cuda = torch.version.cuda is not None or torch.version.hip is not None
    for name in PRELOAD + (() if cuda else PRELOAD_WITHOUT_CUDA):
        try:
            importlib.import_module(name)
        except Exception:  # the child meets the same error importing it itself
            pass
    pid = os.fork()
    if pid == 0:  # the probe: a forked child must be able to start CUDA
        poisoned = getattr(torch._C, "_cuda_isInBadFork", lambda: False)()
        os._exit(1 if poisoned else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0 and _threads() == 1


def _threads() -> int:
    """Threads of this process, native ones included (the kernel's count)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def serve(fd: int) -> dict[str, Any]:
    """The zygote's loop. Returns only in a forked child, with its request."""
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the parent and the children
    ok = _preload()
    _send(sock, {"ready": ok})
    if not ok:
        sys.exit(0)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        _reap(sock)
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        if sock not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
        except OSError:
            data, fds = b"", []
        if not data:
            sys.exit(0)  # the parent is gone; the children follow (their death signal)
        req = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError:
            for f in fds:
                os.close(f)
            _send(sock, {"failed": req["id"]})
            continue
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for f in (wake_r, wake_w):
                os.close(f)
            sock.close()
            _become(req, fds)
            return req
        for f in fds:
            os.close(f)
        _send(sock, {"started": req["id"], "pid": pid})


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "status": os.waitstatus_to_exitcode(status)})


def _become(req: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: the streams, death signal, directory and
    environment of the process it stands for."""
    zygote = os.getppid()
    lifeline.set_parent_death_signal()
    if os.getppid() != zygote:
        os._exit(1)
    for target, f in zip((0, 1, 2), fds):
        os.dup2(f, target)
        os.close(f)
    os.chdir(req["cwd"])
    sys.path[:] = req["path"]  # the parent's import path now, as a fresh interpreter gets it (never "")
    os.environ.clear()
    os.environ.update(req["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    import faulthandler

    faulthandler.enable()


def main() -> None:
    import runpy

    req = serve(int(sys.argv[1]))
    sys.argv[:] = [req["module"], *req["args"]]
    end(lambda: runpy.run_module(req["module"], run_name="__main__", alter_sys=True))


def end(run: Callable[[], object]) -> NoReturn:
    """Call ``run`` and end the process with the status, output and signal
    an interpreter would give it (``SystemExit``'s code, a traceback and 1,
    an uncaught Ctrl-C's SIGINT), without tearing down torch's modules
    (``_finish``). The warm children and the ``gradfuzz`` command end here."""
    try:
        run()
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # as a fresh interpreter ends on an uncaught Ctrl-C
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    _finish()
    os._exit(code)


def _exit_code(code: Any) -> int:
    """``SystemExit.code`` as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish() -> None:
    """A normal exit's work, without the interpreter tearing down every
    module of torch one by one (about 1.1 s on a 2-core host once dynamo is
    imported, paid by every process): non-daemon threads joined, ``atexit``
    callbacks (weakref finalizers, logging, multiprocessing) run, the
    streams flushed; ``end`` then calls ``os._exit``."""
    import atexit

    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError, AttributeError):
            pass


if __name__ == "__main__":
    main()
