"""Process groups for the DTensor paths: a pool the harness starts, or torchrun's.

``WorkerPool``: ``world_size`` real processes forming a real process group
(gloo on CPU, NCCL with one GPU per rank), rendezvous through a FileStore
in a private temp dir (no ports to clash under pytest-xdist). It is started
on first use and reused for every case; each case goes to every rank as its
JSON spec. A case that does not finish within the timeout (a mismatched
collective) or a rank that dies ends in an ``Outcome`` that says so, and
the pool is torn down; the next request starts a fresh one.

No orphans: workers ignore Ctrl-C (the parent tears them down on the way
out, and at exit), and each asks the kernel to SIGKILL it when its parent
dies (``PR_SET_PDEATHSIG``), which covers a parent killed outright.

On CPU the workers are forked from the harness process, which has torch
imported already: start-up is the process group's rendezvous, not
torch's import. With CUDA (or after CUDA is initialised here) they come
from a forkserver instead, since CUDA cannot be used in a forked child.

``TorchrunGroup``: under torchrun the group already exists; rank 0 runs the
harness and sends each case to the other ranks (``host.follow``).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, NoReturn

from harness.machinery_coverage import deposit, slowdown
from harness.materialize import workarounds
from harness.workers import abort, host, trace
from harness.workers.placement import first_gpu
from harness.workers.stillness import POLL, WINDOW, Stillness

START_TIMEOUT = 120.0  # seconds for a fresh pool to rendezvous (a cold torch import included)
FAILED_PEER_GRACE = 5.0  # seconds the other ranks get to answer once one rank has reported a failure
# Where the peers are freed by abort (NCCL): seconds they get to answer on their
# own first, so a peer still computing keeps its answer; the rest are aborted.
ABORT_AFTER = 0.5


class PoolError(RuntimeError):
    """The pool could not start; the message has the workers' logs."""


@dataclass
class Outcome:
    """What came back for one request.

    ``status``: "ok" (every rank replied), "timeout" (some rank did not reply
    in time; ``stacks`` has their Python stacks), "crash" (a rank died;
    ``detail`` has its exit and log). ``replies`` has whatever ranks did
    reply, by rank.
    """

    status: str
    replies: dict[int, Any] = field(default_factory=dict)
    detail: str = ""
    seconds: float = 0.0


def backend_for(world_size: int) -> str:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        import torch.distributed as dist

        if dist.is_nccl_available():
            return "nccl"
    return "gloo"


def torchrun_env() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


_live: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


def _close_all() -> None:
    for pool in list(_live):
        pool.close()


atexit.register(_close_all)


class WorkerPool:
    def __init__(self, world_size: int = 2, backend: str | None = None, start_method: str | None = None) -> None:
        """``start_method`` "fork" or "forkserver"; None picks (see the module doc)."""
        if world_size < 1:
            raise ValueError(f"world size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend or backend_for(world_size)
        self.start_method = start_method
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.tmp: str | None = None
        self.starts = 0  # how many times a pool was started (restarts included)
        # Free the peers of a failed rank by aborting their communicators
        # (``harness.workers.abort``) where /proc cannot show them blocked: NCCL.
        # GRADFUZZ_NCCL_ABORT=0 waits out the grace instead, as before (for a comparison).
        self.abort_peers = self.backend == "nccl" and os.environ.get("GRADFUZZ_NCCL_ABORT", "1") != "0"
        self.aborts = 0  # requests whose waiting peers were aborted
        self._signalled = False
        self.start_seconds: list[float] = []
        self._next_id = 0
        _live.add(self)

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def _context(self) -> Any:
        import torch

        # Fork only where no GPU exists: once autograd has run on a machine with
        # GPUs, its device threads make a forked child unusable ("Unable to
        # handle autograd's threading in combination with fork-based
        # multiprocessing"), gloo or not.
        if self.start_method == "fork" or self.start_method is None and self.backend == "gloo" \
                and sys.platform.startswith("linux") and not torch.cuda.is_available():
            host.preload()
            return mp.get_context("fork")
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["harness.workers.host", "torch._dynamo", "torch.distributed.tensor.parallel"])
        return ctx

    def start(self) -> None:
        if self.alive:
            return
        self.close()
        t0 = time.monotonic()
        ctx = self._context()
        self.tmp = tempfile.mkdtemp(prefix="gradfuzz-pool-")
        store = os.path.join(self.tmp, "store")
        sys.stdout.flush()
        sys.stderr.flush()
        first = first_gpu(self.world_size) if self.backend == "nccl" else 0
        for rank in range(self.world_size):
            here, there = ctx.Pipe(duplex=True)
            log = os.path.join(self.tmp, f"rank{rank}.log")
            proc = ctx.Process(
                target=host.serve,
                args=(there, rank, self.world_size, self.backend, store, log, os.getpid(), first, self.abort_peers),
                name=f"gradfuzz-rank{rank}",
                daemon=True,
            )
            proc.start()
            there.close()
            self.procs.append(proc)
            self.conns.append(here)
        self.starts += 1
        trace.record("starting", self.backend, note=f"{self.world_size} ranks")
        ready = self._gather({"op": None}, START_TIMEOUT, send=False)
        if ready.status != "ok" or not all(r.get("ready") for r in ready.replies.values()):
            errors = [r.get("error", "") for r in ready.replies.values() if not r.get("ready")]
            detail = ready.detail or "\n".join(errors)
            self.close()
            raise PoolError(f"the {self.backend} process group of {self.world_size} ranks did not start: {detail}")
        self.start_seconds.append(time.monotonic() - t0)
        trace.record("start", self.backend, seconds=self.start_seconds[-1], note=f"start {self.starts}")

    def request(self, msg: dict[str, Any], timeout: float) -> Outcome:
        """Send ``msg`` to every rank; wait up to ``timeout`` seconds for all replies."""
        self.start()
        self._next_id += 1
        msg = dict(msg, id=self._next_id, workarounds=workarounds.in_force_now())
        outcome = self._gather(msg, timeout * slowdown(), send=True)
        for reply in outcome.replies.values():  # --coverage: the ranks' lines, kept for the caller's Meter
            if isinstance(reply, dict):
                deposit(reply)
        outcome, lost = lost_device(outcome)
        trace.request(self.backend, msg, outcome, _failed, self._signalled, lost)
        if outcome.status != "ok" or lost or self._signalled:  # an aborted communicator stays broken
            self.close()
        return outcome

    def _gather(self, msg: dict[str, Any], timeout: float, send: bool) -> Outcome:
        t0 = time.monotonic()
        replies: dict[int, Any] = {}
        if send and (broken := self._send_all(msg)) is not None:
            return Outcome("crash", replies, self._death_report([broken]), time.monotonic() - t0)
        pending = set(range(self.world_size))
        deadline = t0 + timeout
        failed: int | None = None  # the first rank that replied with a failure while others were still running
        # Ranks with bounded waits of their own answer by themselves; a GPU rank
        # can sleep in a stream sync while its kernels still run: both keep the grace.
        still = Stillness() if not msg.get("wait") and self.backend == "gloo" and not self.abort_peers else None
        self._signalled = False
        abort_at: float | None = None
        signalled: set[int] = set()
        freed: list[int] = []  # ranks whose answer came after their communicators were aborted
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while pending:
            left = deadline - time.monotonic()
            stuck = failed is not None and still is not None and still.blocked([self.procs[r].pid for r in pending])
            if left <= 0 or stuck:
                return Outcome("timeout", replies, self._stop_reason(pending, failed, stuck, msg, timeout, t0),
                               time.monotonic() - t0)
            if abort_at is not None and not signalled and time.monotonic() >= abort_at:
                signalled = self._abort(pending)
            poll = left if failed is None or (still is None and abort_at is None) else min(left, POLL)
            ready = wait([self.conns[r] for r in pending] + list(sentinels), timeout=poll)
            got, dead = self._received(ready, sentinels, msg, send)
            for rank, reply in got:
                pending.discard(rank)
                if rank in signalled:
                    # An answer once its communicators were aborted (the NCCL error that
                    # raised, values a broken collective left, or a failure it could only
                    # report once freed) is taken as no answer, what the grace gave
                    # before: the verdict does not change with how the peers were let go.
                    freed.append(rank)
                    continue
                replies[rank] = reply
                if failed is None and pending and _failed(reply):
                    failed = rank
                    deadline = min(deadline, time.monotonic() + self._grace(msg))
                    if self.abort_peers and send:
                        # Ranks with a bounded wait of their own (``wait``: the pipeline ranks
                        # free their own p2p group) get that long to answer by themselves.
                        abort_at = time.monotonic() + max(ABORT_AFTER, float(msg.get("wait") or 0))
            dead += [r for s, r in sentinels.items() if s in ready]
            for rank in [r for r in dead if r in signalled and r in pending]:  # ended by its abort: no answer
                pending.discard(rank)
                freed.append(rank)
            dead = [r for r in dead if r not in signalled]
            sentinels = {s: r for s, r in sentinels.items() if r not in freed}
            if dead:
                # Let the others finish or fail (they often raise once a peer is gone).
                self._drain(replies, pending, msg, min(2.0, max(deadline - time.monotonic(), 0)))
                return Outcome("crash", replies, self._death_report(sorted(set(dead))), time.monotonic() - t0)
        return self._answered(replies, failed, freed, time.monotonic() - t0)

    def _send_all(self, msg: dict[str, Any]) -> int | None:
        """``msg`` to every rank; the first rank whose connection broke, else None."""
        data = pickle.dumps(msg)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError:
                return rank
        return None

    @staticmethod
    def _answered(replies: dict[int, Any], failed: int | None, freed: list[int], took: float) -> Outcome:
        """Every rank answered or was let go: ok, or a timeout naming the
        ranks freed by aborting their communicators after a peer failed."""
        if freed:
            return Outcome("timeout", replies, f"rank {failed} failed and its peers did not answer within "
                           f"{ABORT_AFTER:g}s: rank(s) {', '.join(map(str, sorted(freed)))} freed by aborting their "
                           f"NCCL communicators ({took:.2f}s in all)", took)
        return Outcome("ok", replies, "", took)

    def _received(self, ready: list[Any], sentinels: dict[Any, int], msg: dict[str, Any],
                  send: bool) -> tuple[list[tuple[int, Any]], list[int]]:
        """The answers to ``msg`` on the ready connections, by rank, in order;
        and the ranks whose connection broke."""
        got, dead = [], []
        for obj in ready:
            if obj in sentinels:
                continue
            rank = self.conns.index(obj)
            try:
                reply = pickle.loads(obj.recv_bytes())
            except (EOFError, OSError):
                dead.append(rank)
                continue
            if send and reply.get("id") != msg.get("id"):
                continue  # a late answer to an earlier request
            got.append((rank, reply))
        return got, dead

    def _stop_reason(self, pending: set[int], failed: int | None, stuck: bool, msg: dict[str, Any], timeout: float,
                     t0: float) -> str:
        """Why a request stopped waiting: the ranks still pending, and, once one
        failed, whether its peers were blocked for good or ran past the grace."""
        why = self._hang_report(sorted(pending), timeout if failed is None else time.monotonic() - t0)
        if failed is None:
            return why
        waited = (f"were blocked for good (no thread runnable, no CPU used for {WINDOW:g}s)" if stuck
                  else f"did not finish within {self._grace(msg):g}s")
        return f"rank {failed} failed and its peers {waited}: {why}"

    def _abort(self, pending: set[int]) -> set[int]:
        """Ask the pending ranks to abort their communicators (a failed peer
        left them in a collective); the ranks signalled."""
        signalled = set(pending)
        abort.request([self.procs[r].pid for r in signalled if self.procs[r].pid is not None])
        self._signalled = True
        self.aborts += 1
        return signalled

    @staticmethod
    def _grace(msg: dict[str, Any]) -> float:
        """How long the others may still take once a rank failed. A rank that
        raised leaves its peers blocked in a collective that only the
        collective timeout (an hour) would end: the case is over, and the
        group is restarted instead (``request`` closes it). Longer than a
        pipeline rank's own wait for an unmatched send or recv (``wait``),
        after which that peer answers with its timeout by itself."""
        return max(FAILED_PEER_GRACE, float(msg.get("wait") or 0) + 2.0)

    def _drain(self, replies: dict[int, Any], pending: set[int], msg: dict[str, Any], grace: float) -> None:
        end = time.monotonic() + grace
        while pending and time.monotonic() < end:
            live = [self.conns[r] for r in pending if self.procs[r].is_alive()]
            if not live:
                return
            for obj in wait(live, timeout=end - time.monotonic()):
                rank = self.conns.index(obj)
                try:
                    reply = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):
                    pending.discard(rank)
                    continue
                if reply.get("id") == msg.get("id"):
                    replies[rank] = reply
                pending.discard(rank)

    def _log_tail(self, rank: int, chars: int = 1500) -> str:
        if not self.tmp:
            return ""
        try:
            with open(os.path.join(self.tmp, f"rank{rank}.log"), errors="replace") as f:
                text = f.read()
        except OSError:
            return ""
        text = "\n".join(ln for ln in text.splitlines() if "NumPy" not in ln and "_conversion_method" not in ln)
        return text[-chars:].strip()

    def _death_report(self, ranks: list[int]) -> str:
        parts = []
        for r in ranks:
            p = self.procs[r]
            p.join(timeout=1.0)
            code = p.exitcode
            how = (f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
                   else f"exited with status {code}" if code is not None else "stopped answering")
            log = self._log_tail(r, 20000)
            fatal = _fatal(log)
            parts.append(f"rank {r} (pid {p.pid}) {how}" + (f"; {fatal}" if fatal else
                                                          f"; its log ends:\n{log[-1500:]}" if log else ""))
        return "\n".join(parts)

    def _hang_report(self, ranks: list[int], timeout: float) -> str:
        for r in ranks:
            pid = self.procs[r].pid
            if pid is not None and self.procs[r].is_alive():
                try:
                    os.kill(pid, signal.SIGUSR1)  # faulthandler writes its stacks to the log
                except ProcessLookupError:
                    pass
        # A loaded machine takes a while to schedule a rank's signal handler:
        # wait for every stack (up to 3 s) rather than a fixed pause. A rank
        # forked from a deep caller (pytest) dumps long stacks: read enough
        # of the log that the current thread's header is in it.
        deadline = time.monotonic() + 3.0
        while True:
            time.sleep(0.1)
            stacks = {r: _innermost_frames(self._log_tail(r, 64000)) for r in ranks}
            if all(stacks.values()) or time.monotonic() > deadline:
                break
        parts = [f"rank(s) {', '.join(map(str, ranks))} did not finish within {timeout:g}s"]
        parts += [f"rank {r} was at:\n{stack}" for r, stack in stacks.items() if stack]
        return "\n".join(parts)

    def close(self) -> None:
        """Kill every worker, wait for each, remove the rendezvous dir. Idempotent."""
        if self.procs:
            trace.record("close", self.backend)
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass
        for p in self.procs:
            if p.is_alive():
                try:
                    p.kill()
                except (OSError, AttributeError):
                    pass
        for p in self.procs:
            p.join(timeout=5.0)
        self.procs, self.conns = [], []
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def lost_device(outcome: Outcome) -> tuple[Outcome, bool]:
    """A case after which a rank's GPU is unusable (``gpu.device_error``) ends
    in a crash, so the pool replaces its ranks. Where a rank raised in the
    case, that raise is the finding; otherwise the device error is, blamed on
    this case, the one that ran when it happened."""
    lost = {r: rep["device_lost"] for r, rep in outcome.replies.items()
            if isinstance(rep, dict) and rep.get("device_lost")}
    if not lost or outcome.status != "ok" or any(_failed(rep) for rep in outcome.replies.values()):
        return outcome, bool(lost)
    why = "; ".join(f"rank {r}: the GPU is unusable after the case ({m})" for r, m in sorted(lost.items()))
    return Outcome("crash", outcome.replies, why, outcome.seconds), True


def _failed(reply: Any) -> bool:
    """A rank's reply that says the case failed on it (a raise in its rank
    code, or the host's error for a message it could not handle), or that it
    left the case early for a reason of its own (``left_early``: DeepSpeed's
    misuse loop, whose raise is the user being told): either way its peers
    may be blocked in a collective it never joins."""
    return isinstance(reply, dict) and bool(reply.get("failure") or "error" in reply or reply.get("left_early"))


def _fatal(log: str) -> str:
    """A faulthandler crash report, shortened to the error and the innermost frames."""
    at = log.rfind("Fatal Python error")
    if at < 0:
        return ""
    text = log[at:]
    head = text.splitlines()[0].strip()
    frames = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("File")][:8]
    return head + ("; innermost frames:\n" + "\n".join(f"  {f}" for f in frames) if frames else "")


def _innermost_frames(log: str, frames: int = 6) -> str:
    """From a faulthandler dump, the current thread's innermost frames."""
    blocks = log.split("Current thread")
    if len(blocks) < 2:
        return ""
    lines = [ln.strip() for ln in blocks[-1].splitlines()[1:] if ln.strip().startswith("File")]
    return "\n".join(f"  {ln}" for ln in lines[:frames])


class TorchrunGroup:
    """Rank 0's side of a group started by torchrun (or any launcher that sets
    RANK, WORLD_SIZE, MASTER_ADDR): the other ranks are in ``host.follow``.

    A hang cannot be recovered here (the group is the launcher's, not ours):
    on timeout rank 0 prints the case and the finding and exits with status
    124, and the launcher takes the other ranks down.
    """

    def __init__(self, backend: str | None = None) -> None:
        import torch.distributed as dist

        self.world_size = int(os.environ["WORLD_SIZE"])
        self.rank = int(os.environ["RANK"])
        self.backend = backend or backend_for_local()
        self.ctx = host.init_rank(self.rank, self.world_size, self.backend, None, timeout_s=24 * 3600)
        self.control = dist.new_group(backend="gloo") if self.backend != "gloo" else dist.group.WORLD
        self.starts = 1
        self.start_seconds: list[float] = []
        self._next_id = 0
        self._stopped = False
        if self.rank == 0:
            atexit.register(self.stop)

    @property
    def pids(self) -> list[int]:
        return []

    def request(self, msg: dict[str, Any], timeout: float) -> Outcome:
        import torch.distributed as dist

        self._next_id += 1
        msg = dict(msg, id=self._next_id, workarounds=workarounds.in_force_now())
        t0 = time.monotonic()
        watchdog = threading.Timer(timeout, _torchrun_hang, args=(msg, timeout))
        watchdog.daemon = True
        watchdog.start()
        try:
            dist.broadcast_object_list([msg], src=0, group=self.control)
            try:
                mine = host.handle(self.ctx, msg)
            except Exception as e:
                mine = {"error": f"{type(e).__name__}: {e}"}
            gathered: list[Any] = [None] * self.world_size
            dist.gather_object(mine, gathered, dst=0, group=self.control)
        finally:
            watchdog.cancel()
        return Outcome("ok", dict(enumerate(gathered)), "", time.monotonic() - t0)

    def start(self) -> None:
        pass

    def close(self) -> None:
        """Nothing: the launcher's group outlives every phase of a command
        (the gate closes its paths after the replay, then fuzzes on them);
        the other ranks are told to stop when rank 0 exits (``stop``)."""

    def stop(self) -> None:
        import torch.distributed as dist

        if self._stopped or self.rank != 0 or not dist.is_initialized():
            return
        self._stopped = True
        dist.broadcast_object_list([{"op": "stop"}], src=0, group=self.control)
        dist.barrier(group=self.control)  # every rank has read it before any leaves (leave_torchrun)


def backend_for_local() -> str:
    import torch

    import torch.distributed as dist

    if torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def _torchrun_hang(msg: dict[str, Any], timeout: float) -> None:
    case = msg.get("case", "")
    print(
        f"gradfuzz: timeout: a case did not finish on all ranks within {timeout:g}s (a hung collective). "
        f"Under torchrun the group cannot be restarted; stopping. The case:\n{case}",
        file=sys.stderr,
        flush=True,
    )
    os._exit(124)


def follow_torchrun(backend: str | None = None) -> int:
    """Entry for ranks other than 0 under torchrun: join, follow rank 0, exit."""
    import torch.distributed as dist

    backend = backend or backend_for_local()
    ctx = host.init_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), backend, None,
                                timeout_s=24 * 3600)
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return host.follow(ctx, control)


def leave_torchrun(code: int) -> NoReturn:
    """End a torchrun rank without the interpreter's teardown.

    On 2.13 CPU a gloo rank that reaches normal exit aborts now and then
    (SIGABRT, "terminate called without an active exception", with or without
    ``destroy_process_group``: about 1 run in 25 under load), and an abort
    loses rank 0's buffered summary. Everything worth keeping is flushed
    first; the process group is left to the OS, as torchrun's other ranks
    are already told to stop."""
    for g in list(groups.values()):
        if isinstance(g, TorchrunGroup):
            try:
                g.stop()
            except Exception as e:  # a follower already gone: torchrun is taking the group down anyway
                print(f"gradfuzz: the other ranks could not be told to stop: {type(e).__name__}: {e}",
                      file=sys.stderr)
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# --- the process groups of this process: one per (world size, backend), shared by every path family ---

groups: dict[tuple[int, str | None], Any] = {}


def group_key(world_size: int, backend: str | None) -> tuple[int, str | None]:
    return (-1, None) if torchrun_env() else (world_size, backend)


def group(world_size: int, backend: str | None = None) -> Any:
    """The pool (or torchrun group) for this world size and backend, started on first use."""
    key = group_key(world_size, backend)
    if key not in groups:
        groups[key] = TorchrunGroup(backend) if key[0] == -1 else WorkerPool(world_size, backend)
    return groups[key]


def close_group(world_size: int, backend: str | None = None) -> None:
    g = groups.get(group_key(world_size, backend))
    if g is not None:
        g.close()
