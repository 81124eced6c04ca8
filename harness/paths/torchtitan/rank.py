"""What every rank of the torchtitan paths runs.

Each rank builds the case's module as a torchtitan ``Decoder``
(``model.Decoder``), parallelizes it with torchtitan's own functions in the
order ``parallelize_llama`` applies them (activation checkpointing, then
``apply_fsdp_to_decoder`` with the case's reshard policy, float32 params and
reductions), and trains as ``Trainer.train_step`` does: zero the grads,
count the step's valid tokens and sum them over the data-parallel mesh
(``dist_sum_tensor``), then one forward and ``loss.backward()`` per
microbatch with torchtitan's loss reduction (``BaseLoss``: the local sum
loss over the global token count). FSDP reduce-scatters every microbatch
and torchtitan turns FSDP's division off (``set_gradient_divide_factor(1)``),
so grads are sums over ranks after every micro-step.

Each microbatch counts as one token per rank, so the global count is
world x microbatches; each rank's loss is ``sum(output * label)`` with
label = its share of the grad output times that count (``rank_data`` gives
the share times the world size). Summed over ranks and divided by the count,
that is exactly the oracle's grad (exact mode needs both powers of two).
Grads are read after every micro-step as ``full_tensor()`` on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.case.spec import Case
from harness.materialize.schedule import zero_grad
from harness.materialize.tensors import Built
from harness.objects import load_object
from harness.paths.rankfacts import encode, layout_facts, rank_data, rank_failure
from harness.paths.torchtitan import cpu
from harness.paths.torchtitan.data import Knobs, knobs
from harness.paths.torchtitan.model import Decoder
from harness.workers.host import Rank

STOCK = "stock"


def parallelize(model: Decoder, ctx: Rank, ac: str, compiled: bool, k: Knobs) -> None:
    """torchtitan's parallelize of a decoder in ``parallelize_llama``'s order,
    without TP or CP (no Llama plan applies to a generated block): AC per
    block, compile per block, then FSDP2 per block and the root."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    policy = {"full": FullAC, "selective": SelectiveAC}.get(ac)
    if policy is not None:
        policy(policy.Config(preserve_rng_state=k.preserve_rng, determinism_check=k.determinism)).apply(model)
    if compiled:
        _compile(model, ctx)
    apply_fsdp_to_decoder(model, ctx.mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False,
                          reshard_after_forward_policy=k.reshard)
    cpu.adapt(model, ctx.mesh.get_group())


def _compile(model: Decoder, ctx: Rank) -> None:
    """``apply_compile`` with torchtitan's ``aot_eager`` backend (inductor on a
    CPU compiles C++ for every case); dynamo starts afresh per case, so its
    recompile limit never silently falls back to eager."""
    cpu.without_triton()
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.compile import apply_compile

    torch._dynamo.reset()
    dims = ParallelDims(dp_replicate=1, dp_shard=ctx.world_size, cp=1, tp=1, pp=1, ep=1, world_size=ctx.world_size)
    apply_compile(model, compile_config=CompileConfig(enable=True, backend="aot_eager"), parallel_dims=dims)


def applied(model: Decoder) -> dict[str, int]:
    """What torchtitan put on the model: FSDP units, checkpointed and compiled blocks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    layers = list(model.layers.values())
    return {"fsdp": sum(isinstance(m, FSDPModule) for m in model.modules()),
            "checkpointed": sum(isinstance(m, CheckpointWrapper) for m in layers),
            "compiled": sum(getattr(m, "_compiled_call_impl", None) is not None for m in layers)}


def _loss() -> Any:
    """The case's loss in torchtitan's reduction: ``BaseLoss.__call__`` divides
    the local sum, ``sum(output * label)``, by the global token count."""
    from torchtitan.components.loss import BaseLoss

    class CaseLoss(BaseLoss):
        def __init__(self) -> None:
            self.fn = lambda pred, labels: sum((o * c).sum() for o, c in zip(pred, labels))

    return CaseLoss()


def _grads(params: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {n: encode(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad, "R")
            for n, p in params.items()}


def _facts(case: Case, built: Built, k: int, params: dict[str, torch.Tensor], inputs: list[torch.Tensor],
           outs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """What micro-step ``k`` left that the user can read: FSDP has reduced it,
    so the grads are the window's sum so far, on every rank."""
    return {"k": k, "sync": True, "observable": True, "grads": _grads(params),
            "layout": {n: layout_facts(p) for n, p in params.items() if p.grad is not None},
            "input_grads": {x.name: encode(t.grad, "P") for x, t in zip(case.inputs, inputs)},
            "outputs": [encode(o, "R") for o in outs],
            "retained": {n: encode(t.grad, "P") for n, t in built.retained.items()}}


def _tokens(case: Case, ctx: Rank) -> torch.Tensor:
    """The step's global valid tokens as the trainer counts them: one per microbatch here."""
    from torchtitan.distributed.utils import dist_sum_tensor

    return dist_sum_tensor(torch.tensor(case.schedule.microbatches, dtype=torch.int64, device=ctx.device), ctx.mesh)


def run_case(ctx: Rank, case: Case, ac: str, compiled: bool, impl: str) -> dict[str, Any]:
    """One case on this rank. It never raises: the parent judges a failure next to its peers'."""
    built = Built(case)
    out: dict[str, Any] = {"rank": ctx.rank, "steps": [], "failure": None}
    k = -1
    try:
        fault = load_object(impl, "torchtitan impl") if impl != STOCK else None
        model = Decoder(built, built.params(), ctx.device, built.dtype, knobs(case).layers)
        parallelize(model, ctx, ac, compiled, knobs(case))
        out["applied"] = applied(model)
        params, loss_fn, gas = model.params(), _loss(), case.schedule.microbatches
        for k in range(case.schedule.backwards):
            if k % gas == 0:
                zero_grad(params.values(), case.schedule.zero_grad)
                tokens = _tokens(case, ctx)
            inputs, cots = rank_data(case, built, k, ctx)
            outs = model(*inputs)
            live = [(o, c * gas) for o, c in zip(outs, cots) if o.requires_grad]
            if fault is not None:
                fault.before_backward(params, k % gas)
            if live:
                loss, _ = loss_fn([o for o, _ in live], [c for _, c in live], tokens)
                loss.backward()
            out["steps"].append(_facts(case, built, k, params, inputs, outs))
    except Exception as e:  # a rank that raises reports it; the parent judges
        out["failure"] = rank_failure(k, e)
    return out


def handle(ctx: Rank, msg: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank (a ``call`` message from ``harness.paths.torchtitan.paths``),
    or the warm-up before the first: torchtitan imported (``paths.warm``)."""
    if msg.get("warm"):
        import torchtitan.components.loss  # noqa: F401
        import torchtitan.config  # noqa: F401
        import torchtitan.distributed  # noqa: F401
        import torchtitan.models.llama3  # noqa: F401

        return {"rank": ctx.rank, "warm": True}
    return run_case(ctx, Case.loads(msg["case"]), msg["ac"], bool(msg.get("compile")), msg["impl"])
