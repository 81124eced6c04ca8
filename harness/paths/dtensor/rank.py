"""What every rank of the DTensor paths runs.

A rank receives a case as its JSON spec (plus which grad-layout handling to
install), trains it as DTensors on a real process group, and returns raw
facts: each tensor the user could look at as this rank's local shard with
its placements, and for every parameter and backward what reached
``AccumulateGrad`` (placements, strides), what ``.grad`` was before and after,
and which collectives ran in between. Judging those facts is the parent's
job (``harness.paths.dtensor.path``); ranks only report.

Two ways to place parameters, chosen by ``Param.placement``:

- *local* (every parameter ``""``/``"partial"``, the seed's pattern): each
  parameter is a Replicate DTensor used through
  ``to_local(grad_placements=[Partial()])``; the forward runs on plain local
  tensors. Each rank gets its own share of every grad output (the shares sum
  to the case's grad output), so the Partial grads sum to the oracle's grad
  and every rank's local grad differs.
- *dtensor* (``"replicate"``/``"shardD"``): parameters, inputs and grad
  outputs are DTensors (inputs and grad outputs Replicate) and the forward
  runs on DTensors; sharding propagation decides the rest.

Entry points: ``serve`` (a pool worker, fed over a pipe), ``follow`` (a
non-zero rank under torchrun, fed by broadcasts from rank 0) and
``handle`` (one message, used by both and by rank 0 under torchrun).
"""

from __future__ import annotations

import faulthandler
import importlib
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
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from harness.build.tensors import Built
from harness.paths.dtensor.collectives import CollectiveCounter
from harness.case.spec import Case
from harness.build.train import Trainer, ends_step, has_step

STOCK = "stock"  # no grad-layout handling of our own: torch as installed


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


# --- placements -----------------------------------------------------------


def mode_of(case: Case) -> str:
    """"local" when every parameter uses the to_local/Partial pattern, else "dtensor"."""
    kinds = {p.placement or "partial" for p in case.params}
    return "local" if kinds <= {"partial"} else "dtensor"


def placement_of(name: str) -> Any:
    if name == "replicate":
        return Replicate()
    if name.startswith("shard"):
        return Shard(int(name[5:]))
    raise ValueError(f"placement {name!r} has no DTensor form")


def code(placements: Any) -> str:
    """Placements as a short stable string: "R", "P", "P(avg)", "S0"; "," between mesh dims."""
    out = []
    for p in placements:
        if isinstance(p, Replicate):
            out.append("R")
        elif isinstance(p, Partial):
            op = getattr(p, "reduce_op", "sum")
            out.append("P" if op == "sum" else f"P({op})")
        elif type(p) is Shard:
            out.append(f"S{p.dim}")
        else:
            out.append(repr(p))
    return ",".join(out)


def shard_piece(full: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's piece of ``full`` under Shard(dim): torch.chunk's split, empty past the end."""
    pieces = torch.chunk(full, world_size, dim)
    if rank < len(pieces):
        return pieces[rank].contiguous()
    return full.narrow(dim, 0, 0).contiguous()


def share(full: torch.Tensor, rank: int, world_size: int, seed: int, exact: bool) -> torch.Tensor:
    """This rank's share of ``full``: random shares that sum to it.

    Exact mode: small integers, so every share and every rank's grad stays
    exact. Tolerance mode: each element split by random positive fractions,
    so no share is larger than the whole and the terms a rank sums stay
    within the bounds the tolerance was computed for.
    """
    if world_size == 1:
        return full.clone()
    g = torch.Generator().manual_seed(seed)
    if exact:
        parts = [torch.randint(-1, 2, full.shape, generator=g).to(torch.float64) for _ in range(world_size - 1)]
    else:
        weights = torch.rand((world_size,) + tuple(full.shape), generator=g, dtype=torch.float64) + 0.25
        parts = [full * (w / weights.sum(0)) for w in weights[1:]]
    if rank == 0:
        return full - sum(parts)
    return parts[rank - 1]


def dtensor_of(full: torch.Tensor, placement: Any, ctx: Rank) -> DTensor:
    """A DTensor holding ``full`` under ``placement``, built without communication."""
    if isinstance(placement, Shard):
        local = shard_piece(full, placement.dim, ctx.rank, ctx.world_size)
    else:
        local = full
    return DTensor.from_local(local, ctx.mesh, [placement], run_check=False, shape=full.shape, stride=full.stride())


def encode(t: Any, plain: str) -> dict[str, Any] | None:
    """A tensor as facts: placements, this rank's local values (float64, CPU), global shape.

    ``plain`` is the placement a plain tensor stands for (local mode: outputs
    are the same on every rank, "R"; grads of inputs and intermediates are
    this rank's share, "P").
    """
    if t is None:
        return None
    if isinstance(t, DTensor):
        local = t.to_local()
        return {"pl": code(t.placements), "local": local.detach().to("cpu", torch.float64, copy=True),
                "shape": tuple(t.shape), "stride": tuple(t.stride())}
    return {"pl": plain, "local": t.detach().to("cpu", torch.float64, copy=True), "shape": tuple(t.shape),
            "stride": tuple(t.stride()), "plain": True}


# --- grad-layout handling under test ------------------------------------------

_impls: dict[str, Any] = {}


def load_impl(spec: str) -> Any:
    """``stock`` (nothing) or ``MODULE[:ATTR]`` with ``install(params, mesh)``."""
    if spec == STOCK:
        return None
    if spec not in _impls:
        module_name, _, attr = spec.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in filter(None, attr.split(".")):
            obj = getattr(obj, part)
        if not callable(getattr(obj, "install", None)):
            raise TypeError(f"grad-layout implementation {spec!r} has no install(params, mesh)")
        _impls[spec] = obj
    return _impls[spec]


# --- one case -------------------------------------------------------------------


class _Record:
    """Per-parameter hooks that see the grad arrive at AccumulateGrad and leave it."""

    def __init__(self, params: dict[str, torch.nn.Parameter], counter: CollectiveCounter) -> None:
        self.counter = counter
        self.now: dict[str, dict[str, Any]] = {}
        for name, p in params.items():
            if p.requires_grad:
                p.register_hook(self._arrive(name))
                p.register_post_accumulate_grad_hook(self._leave(name))

    def _arrive(self, name: str):
        def hook(g: torch.Tensor) -> None:
            self.now[name] = {
                "arrival": code(g.placements) if isinstance(g, DTensor) else "plain",
                "arrival_stride": tuple(g.stride()),
                "arrival_contiguous": g.is_contiguous(),
                "_mark": self.counter.counts.copy(),
            }

        return hook

    def _leave(self, name: str):
        def hook(p: torch.Tensor) -> None:
            r = self.now.setdefault(name, {"_mark": self.counter.counts.copy()})
            r["post"] = code(p.grad.placements) if isinstance(p.grad, DTensor) else "plain"
            r["window"] = self.counter.since(r.pop("_mark"))

        return hook


def run_case(ctx: Rank, case: Case, impl_spec: str) -> dict[str, Any]:
    built = Built(case)
    dtype, dev, ws = built.dtype, ctx.device, ctx.world_size
    mode = mode_of(case)
    out: dict[str, Any] = {"rank": ctx.rank, "mode": mode, "steps": [], "failure": None}
    k = -1
    try:
        impl = load_impl(impl_spec)
        values = built.params()
        params: dict[str, torch.nn.Parameter] = {}
        tp = {p.name: p.placement for p in case.params if p.placement in TP_STYLES}
        for p in case.params:
            if p.name in tp:
                continue
            full = values[p.name].to(dev, dtype)
            pl = Replicate() if mode == "local" else placement_of(p.placement)
            params[p.name] = torch.nn.Parameter(dtensor_of(full, pl, ctx), requires_grad=p.requires_grad)
        linears = _parallel_linears(case, values, tp, ctx, dtype) if tp else {}
        for n, lin in linears.items():
            params[n] = lin.weight  # (out, in): the case's w transposed
        params = {p.name: params[p.name] for p in case.params}
        sched = case.schedule
        if sched.grad_init != "none":
            prefill = built.prefill()
            for i, p in enumerate(case.params):
                if not p.requires_grad:
                    continue
                full = torch.zeros(p.shape, dtype=torch.float64) if sched.grad_init == "zero" else prefill[p.name]
                if mode == "local":  # a Partial grad, as an earlier backward would have left it
                    part = share(full, ctx.rank, ws, case.seed * 7919 + 3000 + i, case.exact)
                    g = DTensor.from_local(part.to(dev, dtype), ctx.mesh, [Partial()], run_check=False)
                else:
                    full = full.mT if p.name in tp else full
                    g = dtensor_of(full.to(dev, dtype).contiguous(), params[p.name].placements[0], ctx)
                params[p.name].grad = g
        counter = CollectiveCounter()
        record = _Record(params, counter)
        if impl is not None:
            impl.install(params, ctx.mesh)
        trainer = Trainer(case, params, step_with=getattr(impl, "optimizer_step", None),
                          clip_with=getattr(impl, "clip_grad_norm", None)) if has_step(case) else None
        plain_out = "R"
        for k in range(sched.backwards):
            if k and k % sched.microbatches == 0:
                for p in params.values():
                    if sched.zero_grad == "set_to_none":
                        p.grad = None
                    elif sched.zero_grad == "zeros" and p.grad is not None:
                        p.grad.zero_()
            drawn = built.inputs(k)
            inputs: dict[str, torch.Tensor] = {}
            for x in case.inputs:
                t = drawn[x.name].to(dev, dtype)
                if mode == "dtensor":
                    t = DTensor.from_local(t, ctx.mesh, [Replicate()], run_check=False)
                inputs[x.name] = t.requires_grad_(x.requires_grad)
            cots = []
            for i, c in enumerate(built.cotangents(k)):
                if mode == "local":
                    part = share(c, ctx.rank, ws, case.seed * 7919 + 50_000 + 97 * k + i, case.exact)
                    cots.append(part.to(dev, dtype))
                else:
                    cots.append(DTensor.from_local(c.to(dev, dtype), ctx.mesh, [Replicate()], run_check=False))
            prev = {n: (code(p.grad.placements) if isinstance(p.grad, DTensor) else "plain") if p.grad is not None else None
                    for n, p in params.items()}
            if mode == "local":
                used = {n: p.to_local(grad_placements=[Partial()]) for n, p in params.items()}
            else:
                used = {n: _AsLinear(linears[n]) if n in linears else p for n, p in params.items()}
            outs = built.forward({**used, **inputs})
            live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
            record.now = {}
            mark = counter.counts.copy()
            if live:
                with counter:
                    torch.autograd.backward([o for o, _ in live], [c for _, c in live])
            if dev.type == "cuda":
                torch.cuda.synchronize()
            acc = {}
            for n in params:
                r = dict(record.now.get(n, {}))
                r.pop("_mark", None)
                if r:
                    r["prev"] = prev[n]
                    acc[n] = r
            out["steps"].append({
                "k": k,
                "grads": {n: _oriented(n, tp, encode(p.grad, "plain")) for n, p in params.items()},
                "input_grads": {n: encode(t.grad, "P") for n, t in inputs.items()},
                "outputs": [encode(o, plain_out) for o in outs],
                "retained": {n: encode(t.grad, "P") for n, t in built.retained.items()},
                "acc": acc,
                "collectives": counter.since(mark),
            })
            if trainer is not None and ends_step(case, k):
                seen = trainer.step(lambda t: encode(t, "R"))
                out["steps"][-1]["after_step"] = {key: _oriented(key.split(".")[0], tp, e) for key, e in seen.items()}
    except Exception as e:  # a rank that raises reports it; the parent judges
        out["failure"] = {"k": k, "type": type(e).__name__, "message": _first_line(e),
                          "traceback": traceback.format_exc()[-4000:]}
    return out


TP_STYLES = ("colwise", "rowwise")


class _AsLinear:
    """Stands for a weight ``w`` in the case's ``h @ w``: Python hands the
    matmul to ``__rmatmul__``, which runs the parallelized nn.Linear (its
    weight is ``w`` transposed) with the style's input and output handling."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __rmatmul__(self, h: torch.Tensor) -> torch.Tensor:
        return self.module(h)


def _parallel_linears(case: Case, values: dict[str, torch.Tensor], tp: dict[str, str], ctx: Rank,
                      dtype: torch.dtype) -> dict[str, torch.nn.Linear]:
    """One bias-free nn.Linear per tensor-parallel weight, put through
    ``parallelize_module`` with ColwiseParallel / RowwiseParallel (outputs
    kept as DTensors, since the rest of the forward runs on DTensors)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    holder = torch.nn.Module()
    wanted = {p.name: p.requires_grad for p in case.params}
    for name in tp:
        w = values[name]
        lin = torch.nn.Linear(w.shape[0], w.shape[1], bias=False, device=ctx.device, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(w.mT)
        lin.weight.requires_grad_(wanted[name])
        holder.add_module(name, lin)
    plan = {n: ColwiseParallel(use_local_output=False) if style == "colwise" else RowwiseParallel(use_local_output=False)
            for n, style in tp.items()}
    parallelize_module(holder, ctx.mesh, plan)
    return {n: getattr(holder, n) for n in tp}


def _oriented(name: str, tp: dict[str, str], enc: dict[str, Any] | None) -> dict[str, Any] | None:
    """Facts about an nn.Linear weight (out, in) turned into the case's ``w`` (in, out)."""
    if enc is None or name not in tp or len(enc["shape"]) != 2:
        return enc
    swap = {"S0": "S1", "S1": "S0"}
    return dict(enc, local=enc["local"].mT.contiguous(), pl=swap.get(enc["pl"], enc["pl"]),
                shape=tuple(reversed(enc["shape"])), stride=tuple(reversed(enc["stride"])))


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:300]


def handle(ctx: Rank, msg: dict[str, Any]) -> dict[str, Any]:
    op = msg.get("op")
    if op == "run":
        return run_case(ctx, Case.loads(msg["case"]), msg["impl"])
    if op == "ping":
        return {"pong": ctx.rank}
    if op == "call":  # another path's rank code on this group (the pipeline paths): MODULE.handle(ctx, msg)
        return importlib.import_module(msg["module"]).handle(ctx, msg)
    raise ValueError(f"unknown message {op!r}")


# --- process setup ----------------------------------------------------------------


def _die_with_harness(harness: int) -> None:
    """End this process when the harness dies, whatever it is doing.

    The kernel SIGKILLs it when its parent dies (``PR_SET_PDEATHSIG``, Linux);
    the parent is the harness (fork) or the forkserver, which exits when the
    harness does. A watchdog thread covers the rest (another OS, a parent
    that lingers): it polls the harness pid and our parent.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    parent = os.getppid()
    if not _alive(harness) or parent == 1:  # it died before the lines above
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent or not _alive(harness):
                os._exit(1)

    threading.Thread(target=watch, name="gradfuzz-watchdog", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _loopback() -> str | None:
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return None


def init_rank(rank: int, world_size: int, backend: str, store: dist.Store | None, timeout_s: float) -> Rank:
    from datetime import timedelta

    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
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


def serve(conn: Any, rank: int, world_size: int, backend: str, store_path: str, log_path: str, parent: int) -> None:
    """A pool worker: set up, say ready, then answer messages until told to stop."""
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
        ctx = init_rank(rank, world_size, backend, dist.FileStore(store_path, world_size), timeout_s=3600)
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
        try:
            reply = handle(ctx, msg)
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        reply["id"] = msg.get("id")
        conn.send_bytes(pickle.dumps(reply))
    os._exit(0)  # no process-group teardown handshake: the pool may already be going


def follow(ctx: Rank, control: Any) -> int:
    """A non-zero rank under torchrun: run what rank 0 broadcasts until it says stop."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        msg = box[0]
        if msg is None or msg.get("op") == "stop":
            return 0
        try:
            reply = handle(ctx, msg)
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        reply["id"] = msg.get("id")
        dist.gather_object(reply, None, dst=0, group=control)
