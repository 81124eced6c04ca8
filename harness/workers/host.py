"""The rank host: what every process of a harness-started or torchrun group runs.

A rank joins the process group, then answers messages until told to stop:
``ping``, or ``call`` with the ``MODULE`` of a path family's rank code, whose
``handle(ctx, msg)`` does the work (``harness.paths.dtensor.rank``,
``harness.paths.pipeline.rank``). The host knows no path family, so a new
family brings its rank code and reuses the pool, the torchrun follower and
the watchdogs unchanged.

Entry points: ``serve`` (a pool worker, fed over a pipe), ``follow`` (a
non-zero rank under torchrun, fed by broadcasts from rank 0) and ``handle``
(one message, used by both and by rank 0 under torchrun).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from harness.machinery_coverage import attach, child_tracer
from harness.materialize import workarounds
from harness.objects import load_object
from harness.workers import abort, gpu, lifeline
from harness.workers.wire import dumps


def preload() -> None:
    """Import what a rank's first DTensor backward would import (torch._dynamo
    and all it pulls in, about a second). The pool calls this in the parent
    before forking, so ranks start with it loaded instead of each paying."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401


@dataclass
class Rank:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def device_type(self) -> str:
        return self.device.type


def handle(ctx: Rank, msg: dict[str, Any]) -> dict[str, Any]:
    op = msg.get("op")
    if op == "ping":
        return {"pong": ctx.rank}
    if op == "call":  # a path family's rank code on this group: MODULE.handle(ctx, msg)
        with workarounds.in_force(*msg.get("workarounds", ())):  # the gate's outside workaround, for this case
            return load_object(msg["module"], "rank handler").handle(ctx, msg)
    raise ValueError(f"unknown message {op!r}")


# --- process setup ----------------------------------------------------------------


def _die_with_harness(harness: int) -> None:
    """End this process when the harness dies, whatever it is doing.

    The kernel SIGKILLs it when its parent dies (``PR_SET_PDEATHSIG``, Linux);
    the parent is the harness (fork) or the forkserver, which exits when the
    harness does. A watchdog thread covers the rest (another OS, a parent
    that lingers): it polls the harness pid and our parent.
    """
    lifeline.set_parent_death_signal(signal.SIGKILL)
    parent = os.getppid()
    if not lifeline.alive(harness) or parent == 1:  # it died before the line above
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(lifeline.POLL_S)
            if os.getppid() != parent or not lifeline.alive(harness):
                os._exit(1)

    threading.Thread(target=watch, name="gradfuzz-watchdog", daemon=True).start()


def _loopback() -> str | None:
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return None


def init_rank(rank: int, world_size: int, backend: str, store: dist.Store | None, timeout_s: float,
              first: int = 0) -> Rank:
    from datetime import timedelta

    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", first + rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout_s)}
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world_size)
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    mesh = init_device_mesh(device.type, (world_size,))
    return Rank(rank, world_size, device, mesh)


def serve(conn: Any, rank: int, world_size: int, backend: str, store_path: str, log_path: str, parent: int,
          first: int = 0, abortable: bool = False) -> None:
    """A pool worker: set up, say ready, then answer messages until told to stop.

    ``abortable``: the pool may free this rank from a peer's failure by
    aborting its communicators (``harness.workers.abort``, NCCL); armed
    first, so every thread started after it leaves the signal to its own."""
    if abortable:
        abort.arm()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the harness's to handle
    _die_with_harness(parent)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.enable(file=sys.stderr)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    torch.set_num_threads(1)
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        lo = _loopback()
        if lo:
            os.environ["GLOO_SOCKET_IFNAME"] = lo
    try:
        ctx = init_rank(rank, world_size, backend, dist.FileStore(store_path, world_size), timeout_s=3600,
                        first=first)
    except Exception:
        traceback.print_exc()
        conn.send_bytes(pickle.dumps({"ready": False, "error": traceback.format_exc()[-2000:]}))
        return
    conn.send_bytes(pickle.dumps({"ready": True, "rank": rank}))
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if msg.get("op") == "stop":
            break
        tracer = child_tracer()  # --coverage: the machinery lines this request reached go back with the reply
        abort.fired.clear()
        try:
            with tracer if tracer is not None else contextlib.nullcontext():
                reply = handle(ctx, msg)
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        if tracer is not None:
            attach(reply, tracer)
        lost = gpu.device_error(ctx.device)
        if lost:
            reply["device_lost"] = lost
        if abort.fired.is_set():  # what this rank did after the abort is a consequence of it
            reply["aborted"] = True
        reply["id"] = msg.get("id")
        conn.send_bytes(dumps(reply))  # observations: tensors as their bytes (harness.workers.wire)
    os._exit(0)  # no process-group teardown handshake: the pool may already be going


def follow(ctx: Rank, control: Any) -> int:
    """A non-zero rank under torchrun: run what rank 0 broadcasts until it says stop."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        msg = box[0]
        if msg is None or msg.get("op") == "stop":
            dist.barrier(group=control)  # TorchrunGroup.stop's: rank 0 leaves after everyone read it
            return 0
        try:
            reply = handle(ctx, msg)
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        reply["id"] = msg.get("id")
        dist.gather_object(reply, None, dst=0, group=control)
