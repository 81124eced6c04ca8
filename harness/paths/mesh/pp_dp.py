"""What every rank of ``mesh.pp_dp.*`` runs: pipeline x data parallel on a
("pp", "dp") mesh of 4 ranks, ``init_device_mesh(device, (2, 2),
mesh_dim_names=("pp", "dp"))``.

Rank ``r`` sits at ``(pp, dp) = (r // 2, r % 2)``: it holds stage ``pp`` of
the case cut at the pipeline family's cut (``family.pipeline.cuts``,
``harness.materialize.stages``), as every replica ``dp`` does. Both
replicas get the same inputs; replica ``d`` gets ``2 * s_d`` of each grad
output, with shares ``s_d`` that sum to the case's, so the mean over "dp"
is the oracle's grad (as ``harness.paths.parallel`` hands ranks their
shares).

- stock: the stage module wrapped in torch's DDP (``process_group`` the "dp"
  group) or FSDP2 (``fully_shard`` on the "dp" mesh), the wrapper the
  case's mesh data names, in ``PipelineStage`` (group: "pp") driven by the
  schedule the case names with its microbatches (``scale_grads=False``, a
  summed loss): PipelineStage's own data-parallel handling (DDP's
  ``no_sync`` and ``prepare_for_backward`` on the last microbatch, FSDP2's
  ``set_requires_gradient_sync`` / ``set_is_last_backward`` and the
  ``perform_reduce_grad`` that ends the step) is what is tested.
- fixed (``oracles.mesh_pp_dp_fixed``): the same stage module, unwrapped,
  run microbatch by microbatch with ``dist.send`` / ``dist.recv`` over "pp"
  and the step's grads averaged over "dp".

Reported per ``step()``: every held parameter's ``.grad`` as its full value
(``full_tensor()`` over "dp" for FSDP2), with its layout; on the first stage
the grad of each input by microbatch (rows of the stacked input), on the
last stage what the loss was handed per microbatch. The parent
(``harness.paths.mesh.paths.pp_dp_observation``) puts them together.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.case.spec import Case
from harness.materialize import workarounds
from harness.materialize.schedule import starts_step, zero_grad
from harness.materialize.stages import StageModule, cut, examples_of, requires_grad
from harness.materialize.tensors import Built
from harness.objects import load_object
from harness.paths.mesh.data import DIM_SIZES, PP_DP_DIMS, dp_wrapper, pp_schedule
from harness.paths.rankfacts import encode, layout_facts, rank_failure, shard_piece, share
from harness.workers.host import Rank
from harness.paths.stage_loss import target_rows, vjp_loss

STOCK = "stock"
WORLD = DIM_SIZES[0] * DIM_SIZES[1]

_meshes: dict[int, Any] = {}
# "dirty": this rank raised in the last case, so its "pp" group may hold
# unmatched sends and receives; "control": the gloo group the ranks agree
# over (None: the default group, gloo already on CPU).
_state: dict[str, Any] = {"dirty": False, "control": None}


def mesh_pp_dp(ctx: Rank) -> Any:
    """This process's ("pp", "dp") mesh, made once (every rank makes it at the
    same message), and made anew after a case that raised on some rank: the
    pool gives such a case's successor fresh ranks (``PpDpPath.run``), but
    under torchrun the ranks stay, and so would the old sub-groups' unmatched
    messages."""
    import torch.distributed as dist

    if ctx.world_size != WORLD:
        raise RuntimeError(f"mesh.pp_dp needs {WORLD} ranks, this group has {ctx.world_size}")
    if ctx.device.type != "cpu" and _state["control"] is None:
        _state["control"] = dist.new_group(backend="gloo")
    flag = torch.tensor([1.0 if _state["dirty"] else 0.0])
    dist.all_reduce(flag, group=_state["control"])
    if float(flag.item()) > 0:
        _meshes.clear()
        _state["dirty"] = False
    if ctx.world_size not in _meshes:
        from torch.distributed.device_mesh import init_device_mesh

        _meshes[ctx.world_size] = init_device_mesh(ctx.device.type, DIM_SIZES, mesh_dim_names=PP_DP_DIMS)
    return _meshes[ctx.world_size]


def stage_cuts(case: Case) -> tuple[int, ...]:
    """The pipeline family's cuts (read through the spec, not its module: families import each other only
    through the core)."""
    data = case.data("pipeline")
    return tuple(data.cuts) if data is not None else ()


def schedule_class(name: str) -> type:
    import torch.distributed.pipelining as pp

    return getattr(pp, f"Schedule{name}")


def dp_cotangent(case: Case, c: torch.Tensor, dp: int, k: int, i: int) -> torch.Tensor:
    """Replica ``dp``'s grad output: its share times the dp size (the wrappers take the mean)."""
    n = DIM_SIZES[1]
    return n * share(c, dp, n, case.seed * 7919 + 50_000 + 97 * k + i, case.exact)


def _full(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _enc(t: Any, pl: str) -> dict[str, Any] | None:
    return None if t is None else encode(_full(t).detach(), pl)


def _prefill(case: Case, built: Built, specs: list, pp: int) -> dict[str, torch.Tensor]:
    """What each of this stage's ``.grad`` starts as: the case's grad_init on a
    parameter's first copy, zeros on a later stage's copy of a tied weight
    (the copies sum to the one ``.grad`` the case starts from)."""
    init = case.schedule.grad_init
    if init == "none":
        return {}
    owner: dict[str, int] = {}
    for s in specs:
        for n in s.params:
            owner.setdefault(n, s.index)
    prefill = built.prefill() if init == "prefilled" else {}
    frozen = {p.name for p in case.params if not p.requires_grad}
    shapes = {p.name: p.shape for p in case.params}
    return {n: prefill[n] if init == "prefilled" and owner[n] == pp else torch.zeros(shapes[n], dtype=torch.float64)
            for n in specs[pp].params if n not in frozen}


def _target(case: Case, built: Built, ks: range, dp: int, device: Any) -> torch.Tensor:
    """This replica's target rows: its share of each microbatch's grad outputs."""
    return target_rows(lambda k: [dp_cotangent(case, c, dp, k, i) for i, c in enumerate(built.cotangents(k))],
                       ks).to(device, built.dtype)


def _record(step_no: int, ks: range, params: dict[str, Any],
            input_grads: dict[str, list[Any]] | None, seen: dict[int, list[Any]] | None) -> dict[str, Any]:
    rec: dict[str, Any] = {"step": step_no,
                           "grads": {n: _enc(p.grad, "R") for n, p in params.items()},
                           "layout": {n: layout_facts(p) for n, p in params.items() if p.grad is not None}}
    if input_grads is not None:
        rec["input_grads"] = input_grads
    if seen is not None:
        rec["outputs"] = {str(k): [None if o is None else encode(o, "R") for o in (seen.get(k) or [])] for k in ks}
    return rec


def _stock(ctx: Rank, case: Case, built: Built, mesh: Any, out: dict[str, Any]) -> None:
    from torch.distributed.pipelining import PipelineStage

    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    specs = cut(case, stage_cuts(case))
    n_stages, M = len(specs), case.schedule.microbatches
    first, last = pp == 0, pp == n_stages - 1
    module = StageModule(case, specs[pp], built.params(), ctx.device)
    start = _prefill(case, built, specs, pp)
    wrapper = dp_wrapper(case)
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        for n, g in start.items():
            module.weights[n].grad = g.to(ctx.device, built.dtype).clone()
        workarounds.on_params(module.weights)  # the gate's outside workaround, when one is in force
        submod: Any = DistributedDataParallel(
            module, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            process_group=mesh.get_group("dp"), find_unused_parameters=True)
    else:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor, Shard

        dp_mesh = mesh["dp"]
        submod = fully_shard(module, mesh=dp_mesh)
        for n, g in start.items():
            full = g.to(ctx.device, built.dtype)
            module.weights[n].grad = DTensor.from_local(shard_piece(full, 0, dp, DIM_SIZES[1]), dp_mesh, [Shard(0)],
                                                        run_check=False, shape=full.shape, stride=full.stride())
    params = module.weights
    examples = examples_of(built, specs, ctx.device)[pp] if workarounds.stage_example_args() else {}
    stage = PipelineStage(submod, pp, n_stages, ctx.device, group=mesh.get_group("pp"), **examples)
    seen: dict[int, list[Any]] = {}
    schedule = schedule_class(pp_schedule(case))(stage, M, loss_fn=vjp_loss(case, built, seen), scale_grads=False)
    for step_no in range(case.schedule.steps):
        ks = range(step_no * M, (step_no + 1) * M)
        out["k"] = ks[0]
        if starts_step(case, ks[0]):
            zero_grad(params.values(), case.schedule.zero_grad)
        args: list[torch.Tensor] = []
        if first:
            drawn = [built.inputs(k) for k in ks]
            args = [torch.cat([d[x.name] for d in drawn]).to(ctx.device, built.dtype).requires_grad_(x.requires_grad)
                    for x in case.inputs]
        kwargs = {"target": _target(case, built, ks, dp, ctx.device)} if last else {}
        seen.clear()
        schedule.step(*args, return_outputs=False, **kwargs)
        input_grads = {x.name: None if t.grad is None else [encode(c, "P(avg)") for c in t.grad.chunk(M)]
                       for x, t in zip(case.inputs, args)} if first else None
        out["steps"].append(_record(step_no, ks, params, input_grads, seen if last else None))


def _fixed(ctx: Rank, case: Case, built: Built, mesh: Any, impl: Any, out: dict[str, Any]) -> None:
    from harness.case.validate import infer_shapes

    ref = impl.Reference(mesh)
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    specs = cut(case, stage_cuts(case))
    M = case.schedule.microbatches
    first, last = pp == 0, pp == len(specs) - 1
    module = StageModule(case, specs[pp], built.params(), ctx.device)
    params = module.weights
    for n, g in _prefill(case, built, specs, pp).items():
        params[n].grad = g.to(ctx.device, built.dtype).clone()
    shapes_of = infer_shapes(case)
    need = requires_grad(case)
    crossing = specs[-1].inputs  # two stages: what stage 0 sends stage 1
    shapes = [tuple(shapes_of[v.ref] if v.index is None else shapes_of[v.ref][v.index]) for v in crossing]
    needs_grad = [need[v.ref] for v in crossing]
    for step_no in range(case.schedule.steps):
        ks = range(step_no * M, (step_no + 1) * M)
        out["k"] = ks[0]
        if starts_step(case, ks[0]):
            zero_grad(params.values(), case.schedule.zero_grad)
        microbatches, inputs = [], []
        for k in ks:
            drawn = built.inputs(k)
            xs = [drawn[x.name].to(ctx.device, built.dtype).requires_grad_(x.requires_grad) for x in case.inputs]
            inputs.append(xs)
            cots = [dp_cotangent(case, c, dp, k, i).to(ctx.device, built.dtype)
                    for i, c in enumerate(built.cotangents(k))]

            def loss_fn(outs: tuple, cots: list = cots) -> Any:
                terms = [(o * c).sum() for o, c in zip(outs, cots) if o.requires_grad]
                return sum(terms[1:], terms[0]) if terms else None

            microbatches.append((xs if first else [], loss_fn))
        seen, step_grads = ref.step(module, microbatches, shapes, needs_grad, built.dtype, ctx.device)
        ref.reduce_grads(step_grads, params)
        input_grads = {x.name: None if all(xs[i].grad is None for xs in inputs) else
                       [encode(xs[i].grad if xs[i].grad is not None else torch.zeros_like(xs[i]), "P(avg)")
                        for xs in inputs] for i, x in enumerate(case.inputs)} if first else None
        outs = {k: list(o) for k, o in zip(ks, seen)} if last else None
        out["steps"].append(_record(step_no, ks, params, input_grads, outs))


def run_case(ctx: Rank, case: Case, impl_spec: str) -> dict[str, Any]:
    """One case on this rank. It never raises: the parent judges a failure next to its peers' facts."""
    built = Built(case)
    out: dict[str, Any] = {"rank": ctx.rank, "steps": [], "failure": None, "k": -1}
    try:
        mesh = mesh_pp_dp(ctx)
        out["pp"], out["dp"] = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
        if impl_spec == STOCK:
            _stock(ctx, case, built, mesh, out)
        else:
            _fixed(ctx, case, built, mesh, load_object(impl_spec, "mesh.pp_dp reference implementation"), out)
    except Exception as e:  # a rank that raises reports it; the parent judges
        out["failure"] = rank_failure(out["k"], e)
        _state["dirty"] = True
    return out
