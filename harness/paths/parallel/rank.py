"""What every rank of the ddp and fsdp2 paths runs.

All ranks build the same module from the case and run the same inputs;
what differs per rank is its share of each grad output, scaled by the world
size: ``W * s_r`` with ``sum_r s_r`` the case's grad output. DDP and FSDP2
average grads over ranks, so the averaged grad is exactly the oracle's
(linearity in the grad output), while every rank's local grad differs, as
with real per-rank data. Exact mode draws integer shares, so every local
grad is an integer multiple of ``W`` and the division is exact.

Ranks report facts, the parent judges (``harness.paths.parallel.paths``):
each tensor as a placement code and this rank's local values (``R``: must
equal on every rank; ``P(avg)``: the value is the mean over ranks, as a
``no_sync`` backward's local ``.grad`` is; ``S0``: this rank's ``Shard(0)``
piece), which backwards synchronised, how often each parameter's grad was
reduced where the wrapper lets that be counted, and the collectives issued.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from harness.materialize import workarounds
from harness.materialize.schedule import ends_step, ends_window, has_step, starts_step, zero_grad
from harness.materialize.tensors import Built
from harness.materialize.train import Trainer
from harness.materialize.units import CaseModule
from harness.case.spec import Case
from harness.objects import load_object
from harness.workers.collectives import CollectiveCounter
from harness.paths.parallel.data import switches
from harness.paths.rankfacts import encode, layout_facts as _layout, rank_data as _data, rank_failure, shard_piece
from harness.workers.host import Rank

STOCK = "stock"
# Collectives that reduce grads (as the dispatcher names them); all-gathers move parameters.
REDUCING = ("allreduce", "all_reduce", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor")


def _reducing(counts: dict[str, int]) -> int:
    return sum(v for k, v in counts.items() if any(k.startswith(r) for r in REDUCING))


def _ddp(module: CaseModule, ctx: Rank, opts: frozenset[str], reduced: Counter[str]) -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    group = ctx.mesh.get_group()
    ddp = DistributedDataParallel(
        module, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None, process_group=group,
        # A bucket cap far below any parameter: one parameter per bucket, so
        # tied and adjacent parameters are reduced apart.
        bucket_cap_mb=1e-6 if "small_buckets" in opts else 25,
        gradient_as_bucket_view="bucket_view" in opts, static_graph="static_graph" in opts,
        find_unused_parameters="find_unused" in opts)
    names = {id(p): n for n, p in module.params().items()}
    if "bf16_reduce" in opts:  # the hook slot holds one hook: bf16 takes it
        ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
    elif "hook_allreduce" in opts:
        def counted(state, bucket):  # type: ignore[no-untyped-def]  (DDP refuses any annotation but GradBucket)
            for p in bucket.parameters():
                reduced[names.get(id(p), "?")] += 1
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(group, counted)
    elif "hook_builtin" in opts:
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    return ddp


def _fsdp2(module: CaseModule, ctx: Rank, opts: frozenset[str]) -> Any:
    from torch.distributed.fsdp import fully_shard

    from torch.distributed.fsdp import MixedPrecisionPolicy

    reshard: bool | int = False if "keep_unsharded" in opts else 1 if "reshard_int" in opts else True
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if "bf16_reduce" in opts else MixedPrecisionPolicy()
    for block in module.blocks:
        fully_shard(block, mesh=ctx.mesh, reshard_after_forward=reshard, mp_policy=mp)
    return fully_shard(module, mesh=ctx.mesh, reshard_after_forward=reshard, mp_policy=mp)


def load_impl(impl: str) -> Any:
    """``stock`` (None: torch's wrappers) or ``MODULE`` with ``wrap(module, group, mesh, options)``."""
    if impl == STOCK:
        return None
    return load_object(impl, "data-parallel implementation", check=lambda obj: None if callable(
        getattr(obj, "wrap", None)) else "has no wrap(module, group, mesh, options)")


def wrap(kind: str, fixes: Any, module: CaseModule, ctx: Rank, opts: frozenset[str], reduced: Counter[str]) -> Any:
    """The wrapper under test: torch's (``fixes`` None) or ``fixes.wrap``."""
    if fixes is None:
        return _ddp(module, ctx, opts, reduced) if kind == "ddp" else _fsdp2(module, ctx, opts)
    return fixes.wrap(module, ctx.mesh.get_group(), ctx.mesh, opts)


@contextlib.contextmanager
def _window(kind: str, wrapped: Any, sync: bool, opts: frozenset[str]) -> Any:
    """One microbatch inside (``sync``: at the end of) an accumulation window, as each wrapper spells it."""
    if kind == "ddp":
        with contextlib.nullcontext() if sync else wrapped.no_sync():
            yield
        return
    wrapped.set_requires_gradient_sync(sync)
    if "no_reshard_after_backward" in opts:
        wrapped.set_reshard_after_backward(sync)
    yield


def _prefill(kind: str, case: Case, built: Built, params: dict[str, torch.Tensor], ctx: Rank) -> None:
    """Every ``.grad`` as the case starts it: the same full value on every
    rank (DDP), or this rank's piece of it as a ``Shard(0)`` DTensor (FSDP2)."""
    from torch.distributed.tensor import DTensor, Shard

    how = case.schedule.grad_init
    prefill = built.prefill()
    for p in case.params:
        if not p.requires_grad:
            continue
        full = torch.zeros(p.shape, dtype=torch.float64) if how == "zero" else prefill[p.name]
        param = params[p.name]
        full = full.to(ctx.device, param.dtype)
        if isinstance(param, DTensor):
            piece = shard_piece(full, 0, ctx.rank, ctx.world_size)
            param.grad = DTensor.from_local(piece, ctx.mesh, [Shard(0)], run_check=False, shape=full.shape,
                                            stride=full.stride())
        else:
            param.grad = full.clone()


def _arrivals(kind: str, params: dict[str, torch.Tensor]) -> Counter[str]:
    """How many grads reached each parameter (DDP only): one that got a grad
    in an accumulation window must be reduced when the window synchronises."""
    arrived: Counter[str] = Counter()
    if kind == "ddp":
        for n, p in params.items():
            if p.requires_grad:
                p.register_hook(lambda g, n=n: arrived.update([n]))
    return arrived


def _facts(case: Case, built: Built, k: int, kind: str, sync: bool, params: dict[str, torch.Tensor],
           inputs: list[torch.Tensor], outs: list[torch.Tensor]) -> dict[str, Any]:
    """What backward ``k`` left that the user can see. Grads of a backward
    that did not synchronise are each rank's own, whose mean is the grad."""
    grad_pl = "R" if sync else "P(avg)"
    observable = sync or kind == "ddp"  # FSDP2 keeps a no_sync window's grads unsharded, out of sight
    return {
        "k": k,
        "sync": sync,
        "grads": {n: encode(p.grad, grad_pl) for n, p in params.items()} if observable else {},
        "observable": observable,
        "layout": {n: _layout(p) for n, p in params.items() if p.grad is not None and observable},
        "input_grads": {x.name: encode(t.grad, "P(avg)") for x, t in zip(case.inputs, inputs)},
        "outputs": [encode(o, "R") for o in outs],
        "retained": {n: encode(t.grad, "P(avg)") for n, t in built.retained.items()},
        "local_shapes": {n: tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape)
                         for n, p in params.items()},
    }


def run_case(ctx: Rank, case: Case, kind: str, impl: str) -> dict[str, Any]:
    """One case on this rank. It never raises: the parent judges a failure
    next to its peers' facts."""
    built = Built(case)
    data = switches(case)
    opts = frozenset(data.options)
    out: dict[str, Any] = {"rank": ctx.rank, "steps": [], "failure": None}
    k = -1
    try:
        module = CaseModule(built, built.params(), ctx.device, built.dtype, units=data.units if "units" in opts else (),
                            recompute="checkpoint" in opts)
        reduced: Counter[str] = Counter()
        fixes = load_impl(impl)
        wrapped = wrap(kind, fixes, module, ctx, opts, reduced)
        reduced = getattr(wrapped, "reduced", reduced)
        counted = impl != STOCK or (kind == "ddp" and "hook_allreduce" in opts)
        params = module.params()
        if kind == "ddp":  # FSDP2's grads reach its sharded parameters through its own reduce-scatter
            workarounds.on_params(params)  # the gate's outside workaround, when one is in force
        sched = case.schedule
        if sched.grad_init != "none":
            _prefill(kind, case, built, params, ctx)
        arrived = _arrivals(kind, params)
        trainer = Trainer(case, params, step_with=getattr(fixes, "optimizer_step", None),
                          clip_with=getattr(fixes, "clip_grad_norm", None)) if has_step(case) else None
        counter = CollectiveCounter()
        for k in range(sched.backwards):
            if starts_step(case, k):
                zero_grad(params.values(), sched.zero_grad)
            sync = "no_sync" not in opts or ends_window(case, k)
            inputs, cots = _data(case, built, k, ctx)
            mark, reduced_before, arrived_before = counter.counts.copy(), reduced.copy(), arrived.copy()
            with _window(kind, wrapped, sync, opts):
                with counter:
                    outs = wrapped(*inputs)
                    live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
                    if live:
                        torch.autograd.backward([o for o, _ in live], [c for _, c in live])
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            out["steps"].append({
                **_facts(case, built, k, kind, sync, params, inputs, outs),
                "collectives": counter.since(mark),
                "reduced": {n: reduced[n] - reduced_before.get(n, 0) for n in params} if counted else None,
                "with_grad": [n for n, p in params.items() if p.requires_grad and p.grad is not None],
                "arrived": sorted(n for n in arrived if arrived[n] > arrived_before.get(n, 0)) if kind == "ddp" else None,
            })
            if trainer is not None and ends_step(case, k):
                seen = trainer.step(lambda t: encode(t, "R"))
                out["steps"][-1]["after_step"] = seen
    except Exception as e:  # a rank that raises reports it; the parent judges
        out["failure"] = rank_failure(k, e)
    return out


def handle(ctx: Rank, msg: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank (a ``call`` message from ``harness.paths.parallel.paths``)."""
    return run_case(ctx, Case.loads(msg["case"]), msg["kind"], msg["impl"])
