"""What every rank of the DTensor paths runs.

A rank receives a case as its JSON spec (plus which grad-layout handling to
install), trains it as DTensors on a real process group, and returns raw
facts: each tensor the user could look at as this rank's local shard with
its placements, and for every parameter and backward what reached
``AccumulateGrad`` (placements, strides), what ``.grad`` was before and after,
and which collectives ran in between. Judging those facts is the parent's
job (``harness.paths.dtensor.paths``); ranks only report.

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

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from harness.objects import load_object
from harness.workers.host import Rank
from harness.materialize.tensors import Built
from harness.materialize.names import attribute
from harness.workers.collectives import CollectiveCounter
from harness.paths.rankfacts import code, encode, layout_facts, rank_failure, shard_piece, share
from harness.case.spec import Case
from harness.materialize.schedule import ends_step, has_step, starts_step, zero_grad
from harness.materialize import workarounds
from harness.materialize.train import Trainer

STOCK = "stock"  # no grad-layout handling of our own: torch as installed


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


def dtensor_of(full: torch.Tensor, placement: Any, ctx: Rank) -> DTensor:
    """A DTensor holding ``full`` under ``placement``, built without communication."""
    if isinstance(placement, Shard):
        local = shard_piece(full, placement.dim, ctx.rank, ctx.world_size)
    else:
        local = full
    return DTensor.from_local(local, ctx.mesh, [placement], run_check=False, shape=full.shape, stride=full.stride())


# --- grad-layout handling under test ------------------------------------------

_impls: dict[str, Any] = {}


def load_impl(spec: str) -> Any:
    """``stock`` (nothing) or ``MODULE[:ATTR]`` with ``install(params, mesh)``."""
    if spec == STOCK:
        return None
    if spec not in _impls:
        _impls[spec] = load_object(spec, "grad-layout implementation", check=lambda obj: None if callable(
            getattr(obj, "install", None)) else "has no install(params, mesh)")
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


def _parameters(case: Case, values: dict[str, torch.Tensor], tp: dict[str, str], mode: str, ctx: Rank,
                dtype: torch.dtype) -> tuple[dict[str, torch.nn.Parameter], dict[str, torch.nn.Linear]]:
    """Every parameter as a DTensor, in the case's order; a tensor-parallel one
    is the weight of its parallelized nn.Linear (which is returned too)."""
    params: dict[str, torch.nn.Parameter] = {}
    for p in case.params:
        if p.name in tp:
            continue
        full = values[p.name].to(ctx.device, dtype)
        pl = Replicate() if mode == "local" else placement_of(p.placement)
        params[p.name] = torch.nn.Parameter(dtensor_of(full, pl, ctx), requires_grad=p.requires_grad)
    linears = _parallel_linears(case, values, tp, ctx, dtype) if tp else {}
    for n, lin in linears.items():
        params[n] = lin.weight  # (out, in): the case's w transposed
    return {p.name: params[p.name] for p in case.params}, linears


def _prefill(case: Case, built: Built, params: dict[str, torch.nn.Parameter], tp: dict[str, str], mode: str,
             ctx: Rank) -> None:
    """Every ``.grad`` as the case starts it, placed as an earlier backward
    would have left it: a Partial share in local mode, else the parameter's
    placement."""
    sched = case.schedule
    dev, dtype = ctx.device, built.dtype
    prefill = built.prefill()
    for i, p in enumerate(case.params):
        if not p.requires_grad:
            continue
        full = torch.zeros(p.shape, dtype=torch.float64) if sched.grad_init == "zero" else prefill[p.name]
        if mode == "local":
            part = share(full, ctx.rank, ctx.world_size, case.seed * 7919 + 3000 + i, case.exact)
            g = DTensor.from_local(part.to(dev, dtype), ctx.mesh, [Partial()], run_check=False)
        else:
            full = full.mT if p.name in tp else full
            g = dtensor_of(full.to(dev, dtype).contiguous(), params[p.name].placements[0], ctx)
        params[p.name].grad = g


def _data(case: Case, built: Built, k: int, mode: str, ctx: Rank) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Backward ``k``'s inputs and grad outputs. Local mode gives each rank its
    own share of every grad output, so every rank's local grad differs."""
    dev, dtype = ctx.device, built.dtype
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
            part = share(c, ctx.rank, ctx.world_size, case.seed * 7919 + 50_000 + 97 * k + i, case.exact)
            cots.append(part.to(dev, dtype))
        else:
            cots.append(DTensor.from_local(c.to(dev, dtype), ctx.mesh, [Replicate()], run_check=False))
    return inputs, cots


def _backward(case: Case, built: Built, k: int, mode: str, ctx: Rank, params: dict[str, torch.nn.Parameter],
              linears: dict[str, torch.nn.Linear], tp: dict[str, str], record: _Record) -> dict[str, Any]:
    """Backward ``k`` and the facts it leaves: counted collectives, and what
    reached each ``AccumulateGrad`` next to what ``.grad`` was before it."""
    counter = record.counter
    inputs, cots = _data(case, built, k, mode, ctx)
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
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    acc = {}
    for n in params:
        r = dict(record.now.get(n, {}))
        r.pop("_mark", None)
        if r:
            r["prev"] = prev[n]
            acc[n] = r
    return {
        "k": k,
        "grads": {n: _oriented(n, tp, encode(p.grad, "plain")) for n, p in params.items()},
        "layout": {n: layout_facts(p) for n, p in params.items() if p.grad is not None},
        "input_grads": {n: encode(t.grad, "P") for n, t in inputs.items()},
        "outputs": [encode(o, "R") for o in outs],
        "retained": {n: encode(t.grad, "P") for n, t in built.retained.items()},
        "acc": acc,
        "collectives": counter.since(mark),
    }


def run_case(ctx: Rank, case: Case, impl_spec: str) -> dict[str, Any]:
    """One case on this rank. It never raises: the parent judges a failure
    next to its peers' facts."""
    built = Built(case)
    mode = mode_of(case)
    out: dict[str, Any] = {"rank": ctx.rank, "mode": mode, "steps": [], "failure": None}
    k = -1
    try:
        impl = load_impl(impl_spec)
        values = built.params()
        tp = {p.name: p.placement for p in case.params if p.placement in TP_STYLES}
        params, linears = _parameters(case, values, tp, mode, ctx, built.dtype)
        workarounds.on_params(params)  # the gate's outside workaround, when one is in force
        sched = case.schedule
        if sched.grad_init != "none":
            _prefill(case, built, params, tp, mode, ctx)
        record = _Record(params, CollectiveCounter())
        if impl is not None:
            impl.install(params, ctx.mesh)
        trainer = Trainer(case, params, step_with=getattr(impl, "optimizer_step", None),
                          clip_with=getattr(impl, "clip_grad_norm", None)) if has_step(case) else None
        for k in range(sched.backwards):
            if starts_step(case, k):
                zero_grad(params.values(), sched.zero_grad)
            out["steps"].append(_backward(case, built, k, mode, ctx, params, linears, tp, record))
            if trainer is not None and ends_step(case, k):
                seen = trainer.step(lambda t: encode(t, "R"))
                out["steps"][-1]["after_step"] = {key: _oriented(key.split(".")[0], tp, e) for key, e in seen.items()}
    except Exception as e:  # a rank that raises reports it; the parent judges
        out["failure"] = rank_failure(k, e)
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
        holder.add_module(attribute(name), lin)
    plan = {attribute(n): ColwiseParallel(use_local_output=False) if style == "colwise"
            else RowwiseParallel(use_local_output=False) for n, style in tp.items()}
    parallelize_module(holder, ctx.mesh, plan)
    return {n: getattr(holder, attribute(n)) for n in tp}


def _oriented(name: str, tp: dict[str, str], enc: dict[str, Any] | None) -> dict[str, Any] | None:
    """Facts about an nn.Linear weight (out, in) turned into the case's ``w`` (in, out)."""
    if enc is None or name not in tp or len(enc["shape"]) != 2:
        return enc
    swap = {"S0": "S1", "S1": "S0"}
    return dict(enc, local=enc["local"].mT.contiguous(), pl=swap.get(enc["pl"], enc["pl"]),
                shape=tuple(reversed(enc["shape"])), stride=tuple(reversed(enc["stride"])))


def handle(ctx: Rank, msg: dict[str, Any]) -> dict[str, Any]:
    """One DTensor case on this rank (a ``call`` message from ``harness.paths.dtensor.paths``)."""
    return run_case(ctx, Case.loads(msg["case"]), msg["impl"])


