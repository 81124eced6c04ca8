"""What every rank of the mesh paths runs, on a 2 x 2 ("dp", "tp") mesh of 4 ranks.

Rank ``r`` sits at ``(dp, tp) = (r // 2, r % 2)``. Two machineries:

- ``fsdp_tp`` (stock): the case as a module whose tensor-parallel weights
  (``colwise`` / ``rowwise`` codes, ``data.Placements``) are nn.Linear layers
  put through ``parallelize_module`` on "tp" and every other parameter a
  Replicate DTensor on "tp"; then ``fully_shard`` over "dp", as torchtitan
  composes them. The forward runs on DTensors of the "tp" mesh. Both ranks of
  one dp group get the same inputs and grad outputs; dp group ``d`` gets
  ``2 * s_d`` with shares ``s_d`` that sum to the case's grad output, so
  FSDP2's mean over "dp" is the oracle's grad.
- ``fsdp_tp`` (fixed, ``oracles.mesh_fixed``): plain full parameters on every
  rank; each rank's grad output is its own share over "tp" of its dp
  group's ``2 * s_d``; after every backward the reference all-reduces each
  grad over "tp", then over "dp" and divides by the dp size.
- ``dtensor2d``: every parameter a DTensor on the 2-D mesh with the placements
  its code names; inputs Replicate on both dims, grad outputs too, or (with
  ``partial_dp``) each dp group's share as ``(Partial(), Replicate())``; the
  forward runs on DTensors. Stock is torch's AccumulateGrad; fixed installs
  ``oracles.dtensor_fixed`` (layout fix, its own optimizer grads).

Every tensor is reported as its full value (``full_tensor()`` outside the
backward), so the parent's ``harness.paths.assemble`` puts values together
with its 1-D rules: ``R`` (must agree on every rank) for grads, outputs and
steps; ``P(avg)`` for input and retained grads of ``fsdp_tp``, which are each
dp group's own (the mean over the 4 ranks is the grad).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from harness.case.spec import Case
from harness.materialize.names import attribute
from harness.materialize.schedule import ends_step, has_step, starts_step, zero_grad
from harness.materialize.tensors import Built
from harness.materialize import workarounds
from harness.materialize.train import Trainer
from harness.objects import load_object
from harness.paths.mesh.data import DIM_SIZES, MESH_DIMS, STYLES, partial_dp, placements, split
from harness.paths.rankfacts import encode, layout_facts, rank_failure, share
from harness.workers.host import Rank

STOCK = "stock"
WORLD = DIM_SIZES[0] * DIM_SIZES[1]

_meshes: dict[int, Any] = {}


def mesh2d(ctx: Rank) -> Any:
    """This process's ("dp", "tp") mesh, made once (every rank makes it at the same message)."""
    if ctx.world_size != WORLD:
        raise RuntimeError(f"the mesh paths need {WORLD} ranks, this group has {ctx.world_size}")
    if ctx.world_size not in _meshes:
        from torch.distributed.device_mesh import init_device_mesh

        _meshes[ctx.world_size] = init_device_mesh(ctx.device.type, DIM_SIZES, mesh_dim_names=MESH_DIMS)
    return _meshes[ctx.world_size]


def load_impl(spec: str) -> Any:
    if spec == STOCK:
        return None
    return load_object(spec, "mesh reference implementation")


def _full(t: Any) -> Any:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _enc(t: Any, pl: str, transpose: bool = False) -> dict[str, Any] | None:
    """The full value of ``t`` as a fact (a collective for a DTensor: every rank calls it in one order)."""
    if t is None:
        return None
    f = _full(t).detach()
    return encode(f.mT if transpose and f.dim() == 2 else f, pl)


def _placement(code: str) -> Any:
    return Replicate() if code == "R" else Shard(int(code[1:]))


def tp_styles(case: Case) -> dict[str, str]:
    return {p.name: split(c)[1] for p, c in zip(case.params, placements(case)) if split(c)[1] in STYLES}


def placements_2d(case: Case) -> dict[str, tuple[str, str]]:
    """dtensor2d: each parameter's (dp, tp) placement; a style is the Shard it makes of ``w`` (in, out)."""
    out = {}
    for p, c in zip(case.params, placements(case)):
        dp, tp = split(c)
        out[p.name] = (dp, {"colwise": "S1", "rowwise": "S0"}.get(tp, tp))
    return out


def _dp_share(case: Case, c: torch.Tensor, dp: int, k: int, i: int) -> torch.Tensor:
    """Dp group ``dp``'s grad output: its share, times the dp size (FSDP2 takes the mean)."""
    n = DIM_SIZES[0]
    return n * share(c, dp, n, case.seed * 7919 + 50_000 + 97 * k + i, case.exact)


class _AsLinear:
    """Stands for ``w`` in the case's ``h @ w``: runs the parallelized nn.Linear (weight ``w.mT``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __rmatmul__(self, h: torch.Tensor) -> torch.Tensor:
        return self.module(h)


class MeshModule(torch.nn.Module):
    """The case's forward over its parameters; tensor-parallel weights as bias-free nn.Linear layers."""

    def __init__(self, built: Built, values: dict[str, torch.Tensor], tp: dict[str, str], device: Any,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.built = built
        self.tp = tp
        self.linears = torch.nn.ModuleDict()
        for p in built.case.params:
            v = values[p.name].to(device, dtype)
            if p.name in tp:
                lin = torch.nn.Linear(v.shape[0], v.shape[1], bias=False, device=device, dtype=dtype)
                with torch.no_grad():
                    lin.weight.copy_(v.mT)
                lin.weight.requires_grad_(p.requires_grad)
                self.linears[attribute(p.name)] = lin
            else:
                self.register_parameter(attribute(p.name), torch.nn.Parameter(v, requires_grad=p.requires_grad))

    def params(self) -> dict[str, torch.Tensor]:
        return {p.name: self.linears[attribute(p.name)].weight if p.name in self.tp else getattr(self, attribute(p.name))
                for p in self.built.case.params}

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        case = self.built.case
        env: dict[str, Any] = {x.name: t for x, t in zip(case.inputs, inputs)}
        for p in case.params:
            a = attribute(p.name)
            env[p.name] = _AsLinear(self.linears[a]) if p.name in self.tp else getattr(self, a)
        return tuple(self.built.forward(env))


def _fsdp_tp(case: Case, built: Built, mesh: Any, ctx: Rank,
             values: dict[str, torch.Tensor] | None = None) -> tuple[MeshModule, dict[str, torch.Tensor]]:
    """TP over "tp" (styles, else Replicate), then FSDP2 over "dp", on the
    case's parameter values (or ``values``)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    tp = tp_styles(case)
    module = MeshModule(built, built.params() if values is None else values, tp, ctx.device, built.dtype)
    if tp:
        plan = {f"linears.{attribute(n)}": ColwiseParallel(use_local_output=False) if style == "colwise"
                else RowwiseParallel(use_local_output=False) for n, style in tp.items()}
        parallelize_module(module, tp_mesh, plan)
    for p in case.params:
        if p.name not in tp:
            t = getattr(module, attribute(p.name)).detach()
            module.register_parameter(attribute(p.name), torch.nn.Parameter(
                DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False), requires_grad=p.requires_grad))
    fully_shard(module, mesh=dp_mesh)
    return module, module.params()


def _steps_fsdp_tp(case: Case, built: Built, mesh: Any, ctx: Rank, out: dict[str, Any]) -> None:
    module, params = _fsdp_tp(case, built, mesh, ctx)
    tp_mesh = mesh["tp"]
    dp = mesh.get_local_rank("dp")
    tp = tp_styles(case)
    sched = case.schedule
    if sched.grad_init != "none":
        # Each .grad as FSDP2 x TP lays out its parameter: the prefill put
        # through the same parallelize_module and fully_shard, its local
        # pieces taken (FSDP2's dp shards of a tp-sharded weight are
        # _StridedShard, which distribute_tensor does not build).
        _, shaped = _fsdp_tp(case, built, mesh, ctx, _prefill_values(case, built))
        for p in case.params:
            if p.requires_grad:
                q, param = shaped[p.name], params[p.name]
                param.grad = DTensor.from_local(q.to_local().detach().clone(), param.device_mesh, param.placements,
                                                run_check=False, shape=param.shape, stride=param.stride())
    trainer = Trainer(case, params) if has_step(case) else None
    for k in range(sched.backwards):
        out["k"] = k
        if starts_step(case, k):
            zero_grad(params.values(), sched.zero_grad)
        drawn = built.inputs(k)
        inputs = [DTensor.from_local(drawn[x.name].to(ctx.device, built.dtype), tp_mesh, [Replicate()],
                                     run_check=False).requires_grad_(x.requires_grad) for x in case.inputs]
        cots = [DTensor.from_local(_dp_share(case, c, dp, k, i).to(ctx.device, built.dtype), tp_mesh, [Replicate()],
                                   run_check=False) for i, c in enumerate(built.cotangents(k))]
        outs = module(*inputs)
        live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
        if live:
            torch.autograd.backward([o for o, _ in live], [c for _, c in live])
        out["steps"].append({
            "k": k,
            "grads": {n: _enc(p.grad, "R", n in tp) for n, p in params.items()},
            "layout": {n: layout_facts(p) for n, p in params.items() if p.grad is not None},
            "input_grads": {x.name: _enc(t.grad, "P(avg)") for x, t in zip(case.inputs, inputs)},
            "outputs": [_enc(o, "R") for o in outs],
            "retained": {n: _enc(t.grad, "P(avg)") for n, t in built.retained.items()},
        })
        if trainer is not None and ends_step(case, k):
            seen = trainer.step(lambda t: _enc(t, "R"))
            out["steps"][-1]["after_step"] = {key: _oriented(key, tp, e) for key, e in seen.items()}


def _prefill_values(case: Case, built: Built) -> dict[str, torch.Tensor]:
    """What each ``.grad`` starts as (grad_init "zero" or "prefilled"), full, in the case's orientation."""
    prefill = built.prefill()
    return {p.name: torch.zeros(p.shape, dtype=torch.float64) if case.schedule.grad_init == "zero" else prefill[p.name]
            for p in case.params}


def _oriented(key: str, tp: dict[str, str], e: dict[str, Any] | None) -> dict[str, Any] | None:
    """A fact about an nn.Linear weight (out, in) turned into the case's ``w`` (in, out)."""
    if e is None or key.split(".")[0] not in tp or len(e["shape"]) != 2:
        return e
    return encode(e["local"].mT, "R")


def _steps_fixed(case: Case, built: Built, mesh: Any, ctx: Rank, impl: Any, out: dict[str, Any]) -> None:
    """The reference of ``oracles.mesh_fixed``: plain tensors, plain collectives."""
    ref = impl.Reference(mesh)
    dp, tpr = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    values = built.params()
    params = {p.name: torch.nn.Parameter(values[p.name].to(ctx.device, built.dtype), requires_grad=p.requires_grad)
              for p in case.params}
    sched = case.schedule
    if sched.grad_init != "none":
        start = _prefill_values(case, built)
        for p in case.params:
            if p.requires_grad:
                params[p.name].grad = start[p.name].to(ctx.device, built.dtype).clone()
    trainer = Trainer(case, params, step_with=getattr(impl, "optimizer_step", None)) if has_step(case) else None
    for k in range(sched.backwards):
        out["k"] = k
        if starts_step(case, k):
            zero_grad(params.values(), sched.zero_grad)
        drawn = built.inputs(k)
        inputs = {x.name: drawn[x.name].to(ctx.device, built.dtype).requires_grad_(x.requires_grad) for x in case.inputs}
        # This rank's own part (shares over "tp") of its dp group's grad output.
        cots = [share(_dp_share(case, c, dp, k, i), tpr, DIM_SIZES[1], case.seed * 7919 + 70_000 + 97 * k + 13 * dp + i,
                      case.exact).to(ctx.device, built.dtype) for i, c in enumerate(built.cotangents(k))]
        leaves = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params.items()}
        outs = built.forward({**leaves, **inputs})
        live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
        if live:
            torch.autograd.backward([o for o, _ in live], [c for _, c in live])
        ref.reduce_grads(leaves, params)
        out["steps"].append({
            "k": k,
            "grads": {n: _enc(p.grad, "R") for n, p in params.items()},
            "layout": {n: layout_facts(p) for n, p in params.items() if p.grad is not None},
            "input_grads": {n: _enc(ref.over_tp(t.grad), "P(avg)") for n, t in inputs.items()},
            "outputs": [_enc(o, "R") for o in outs],
            "retained": {n: _enc(ref.over_tp(t.grad), "P(avg)") for n, t in built.retained.items()},
        })
        if trainer is not None and ends_step(case, k):
            out["steps"][-1]["after_step"] = trainer.step(lambda t: _enc(t, "R"))


def _steps_dtensor2d(case: Case, built: Built, mesh: Any, ctx: Rank, impl: Any, out: dict[str, Any]) -> None:
    from torch.distributed.tensor import distribute_tensor

    values = built.params()
    pls = placements_2d(case)
    params = {p.name: torch.nn.Parameter(distribute_tensor(values[p.name].to(ctx.device, built.dtype), mesh,
                                                           [_placement(x) for x in pls[p.name]]),
                                         requires_grad=p.requires_grad) for p in case.params}
    workarounds.on_params(params)  # the gate's outside workaround, when one is in force
    sched = case.schedule
    if sched.grad_init != "none":
        start = _prefill_values(case, built)
        for p in case.params:
            if p.requires_grad:
                params[p.name].grad = distribute_tensor(start[p.name].to(ctx.device, built.dtype), mesh,
                                                        params[p.name].placements)
    if impl is not None:
        impl.install(params, mesh)
    trainer = Trainer(case, params, step_with=getattr(impl, "optimizer_step", None),
                      clip_with=getattr(impl, "clip_grad_norm", None)) if has_step(case) else None
    both = [Replicate(), Replicate()]
    split_dp, dp = partial_dp(case), mesh.get_local_rank("dp")
    for k in range(sched.backwards):
        out["k"] = k
        if starts_step(case, k):
            zero_grad(params.values(), sched.zero_grad)
        drawn = built.inputs(k)
        inputs = {x.name: DTensor.from_local(drawn[x.name].to(ctx.device, built.dtype), mesh, both, run_check=False)
                  .requires_grad_(x.requires_grad) for x in case.inputs}
        cots = [DTensor.from_local(c.to(ctx.device, built.dtype), mesh, both, run_check=False) if not split_dp else
                DTensor.from_local(share(c, dp, DIM_SIZES[0], case.seed * 7919 + 50_000 + 97 * k + i, case.exact)
                                   .to(ctx.device, built.dtype), mesh, [Partial(), Replicate()], run_check=False)
                for i, c in enumerate(built.cotangents(k))]
        outs = built.forward({**params, **inputs})
        live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
        if live:
            torch.autograd.backward([o for o, _ in live], [c for _, c in live])
        out["steps"].append({
            "k": k,
            "grads": {n: _enc(p.grad, "R") for n, p in params.items()},
            "layout": {n: layout_facts(p) for n, p in params.items() if p.grad is not None},
            "input_grads": {n: _enc(t.grad, "R") for n, t in inputs.items()},
            "outputs": [_enc(o, "R") for o in outs],
            "retained": {n: _enc(t.grad, "R") for n, t in built.retained.items()},
        })
        if trainer is not None and ends_step(case, k):
            out["steps"][-1]["after_step"] = trainer.step(lambda t: _enc(t, "R"))


def run_case(ctx: Rank, case: Case, kind: str, impl_spec: str) -> dict[str, Any]:
    """One case on this rank. It never raises: the parent judges a failure next to its peers' facts."""
    built = Built(case)
    out: dict[str, Any] = {"rank": ctx.rank, "steps": [], "failure": None, "k": -1}
    try:
        mesh = mesh2d(ctx)
        impl = load_impl(impl_spec)
        if kind == "fsdp_tp":
            if impl is None:
                _steps_fsdp_tp(case, built, mesh, ctx, out)
            else:
                _steps_fixed(case, built, mesh, ctx, impl, out)
        elif kind == "dtensor2d":
            _steps_dtensor2d(case, built, mesh, ctx, impl, out)
        else:
            raise ValueError(f"unknown mesh machinery {kind!r}")
    except Exception as e:  # a rank that raises reports it; the parent judges
        out["failure"] = rank_failure(out["k"], e)
    return out


def handle(ctx: Rank, msg: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank (a ``call`` message from ``harness.paths.mesh.paths``)."""
    if msg["kind"] == "pp_dp":  # its own mesh, ("pp", "dp"): harness.paths.mesh.pp_dp
        from harness.paths.mesh import pp_dp

        return pp_dp.run_case(ctx, Case.loads(msg["case"]), msg["impl"])
    return run_case(ctx, Case.loads(msg["case"]), msg["kind"], msg["impl"])
