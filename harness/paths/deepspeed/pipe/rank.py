"""What every rank of ``deepspeed.pipe.*`` runs: the case cut in two stages
(``stages.cut_of``), one per rank, as a ``deepspeed.pipe.PipelineModule``.

A stage is a sequence of layers, as the engine wants it: one
``TiedLayerSpec`` per parameter that both stages use (its copy on each
stage; DeepSpeed all-reduces their grads over the two), which appends its
``weight`` to the activations, then one ``LayerSpec`` of the stage's own
nodes and parameters. Stages are padded with identity layers to the same
length so the ``uniform`` partition puts each on its rank.

Each step of the case is one ``engine.train_batch`` over its microbatches:
the data iterator hands the first stage the case's inputs and the last
stage (as labels) the microbatch number and its grad outputs; the loss is
``gas * sum(output * grad output)``, since the engine divides the loss by
the accumulation steps. There is no data parallelism (two ranks, two
stages), so no share of the grad outputs.

Grads are read with ``safe_get_full_grad`` as the engine's optimizer is
about to step (after the tied all-reduce), on the ranks that hold each
parameter: the engine zeroes them right after, before ``train_batch``
returns.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from harness.case.spec import Case
from harness.materialize import workarounds
from harness.materialize.stages import StageModule, StageSpec
from harness.materialize.tensors import Built
from harness.paths.deepspeed.data import pipe_config
from harness.paths.deepspeed.pipe.stages import bodies
from harness.paths.deepspeed.rank import _deepspeed
from harness.paths.rankfacts import encode, rank_failure
from harness.workers.host import Rank


class Holder(torch.nn.Module):
    """A tied parameter's copy on one stage, under the attribute name
    ``TiedLayerSpec`` all-reduces by default (``tied_weight_attr``)."""

    def __init__(self, name: str, value: torch.Tensor, trainable: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(value.clone(), requires_grad=trainable)
        self.weight.case_name = name


def _append(holder: Holder, x: Any) -> tuple:
    return (*_as_tuple(x), holder.weight)


def _as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _identity(x: Any) -> Any:
    return x


class Body(StageModule):
    """A stage's nodes over its own parameters; the tied ones arrive after
    the activations, appended by the stage's tied layers."""

    def __init__(self, case: Case, spec: StageSpec, values: dict[str, torch.Tensor]) -> None:
        super().__init__(case, spec, values)
        for n, p in self.weights.items():
            p.case_name = n

    def forward(self, x: Any) -> Any:  # type: ignore[override]
        return super().forward(*_as_tuple(x))


def _layers(case: Case, built: Built) -> list[Any]:
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    values = {n: v.to(built.dtype) for n, v in built.params().items()}
    trainable = {p.name: p.requires_grad for p in case.params}
    stages = []
    for mine, body in bodies(case):
        stages.append([TiedLayerSpec(n, Holder, n, values[n], trainable[n], forward_fn=_append) for n in mine]
                      + [LayerSpec(Body, case, body, values)])
    width = max(len(s) for s in stages)
    return [layer for s in stages for layer in [_identity] * (width - len(s)) + s]


def _loss_fn(case: Case, seen: dict[int, list[torch.Tensor]]) -> Callable[[Any, tuple], torch.Tensor]:
    gas = case.schedule.microbatches

    def loss_fn(outputs: Any, labels: tuple) -> torch.Tensor:
        k, cots = int(labels[0]), labels[1:]
        outs = _as_tuple(outputs)
        seen[k] = [o.detach().clone() for o in outs]
        terms = [(o * c).sum() for o, c in zip(outs, cots) if o.requires_grad]
        return gas * sum(terms[1:], terms[0])

    return loss_fn


def _read_before_step(engine: Any, read: Callable[[], None]) -> None:
    """Read the grads the engine settled on (reduced, tied ones summed) as
    its optimizer (the client SGD, or ZeRO's wrapper of it) is about to
    step: the engine zeroes them before ``train_batch`` returns."""
    step = engine.optimizer.step

    def reading_step(*args: Any, **kwargs: Any) -> Any:
        read()
        return step(*args, **kwargs)

    engine.optimizer.step = reading_step


def _batch(case: Case, built: Built, ks: range) -> list[tuple[Any, tuple]]:
    out = []
    for k in ks:
        drawn = built.inputs(k)
        xs = tuple(drawn[x.name].to(built.dtype) for x in case.inputs)
        cots = tuple(c.to(built.dtype) for c in built.cotangents(k))
        out.append((xs[0] if len(xs) == 1 else xs, (torch.tensor(float(k)), *cots)))
    return out


def run_case(ctx: Rank, case: Case, stage: int) -> dict[str, Any]:
    """One case on this rank. It never raises: the parent judges a failure next to its peers'."""
    built = Built(case)
    out: dict[str, Any] = {"rank": ctx.rank, "steps": [], "failure": None}
    seen: dict[int, list[torch.Tensor]] = {}
    read: dict[int, dict[str, Any]] = {}
    M = case.schedule.microbatches
    k = -1
    try:
        deepspeed = _deepspeed(ctx)
        deepspeed.comm.init_distributed()
        from deepspeed.pipe import PipelineModule
        from deepspeed.utils import safe_get_full_grad

        module = PipelineModule(_layers(case, built), num_stages=2, loss_fn=_loss_fn(case, seen),
                                partition_method="uniform")
        params = [p for p in module.parameters() if hasattr(p, "case_name")]
        workarounds.on_params({str(i): p for i, p in enumerate(params)})  # the gate's outside workaround, if any
        opt = torch.optim.SGD([p for p in params if p.requires_grad], lr=0.0)
        engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=pipe_config(case, stage))
        step = [0]
        _read_before_step(engine, lambda: read.__setitem__(step[0], {
            p.case_name: encode(safe_get_full_grad(p), "R") for p in params}))
        for s in range(case.schedule.steps):
            k, step[0] = s * M, s
            engine.train_batch(iter(_batch(case, built, range(s * M, s * M + M))))
            out["steps"] += [_facts(k2, k2 % M == M - 1, read.get(s, {}), seen) for k2 in range(s * M, s * M + M)]
    except Exception as e:  # a rank that raises reports it; the parent judges
        out["failure"] = rank_failure(k, e)
    finally:
        _forget_grid()
    return out


def _forget_grid() -> None:
    """The pipeline engine leaves its grid in DeepSpeed's module-global
    ``groups.mpu``; the next plain engine on these ranks (the ZeRO paths
    share the pool) would read two model-parallel ranks from it and fail
    at start (``'NoneType' object has no attribute 'get_model_parallel_rank'``)."""
    try:
        from deepspeed.utils import groups
    except ImportError:
        return
    groups.mpu = None


def _facts(k: int, boundary: bool, grads: dict[str, Any], seen: dict[int, list[torch.Tensor]]) -> dict[str, Any]:
    """Micro-step ``k`` as this rank saw it: the grads of the parameters it
    holds at a boundary, the last stage's outputs (only it has them)."""
    return {"k": k, "sync": boundary, "observable": boundary, "grads": grads if boundary else {},
            "input_grads": {}, "retained": {},
            "outputs": [encode(o, "R") for o in seen[k]] if k in seen else None}


def handle(ctx: Rank, msg: dict[str, Any]) -> dict[str, Any]:
    return run_case(ctx, Case.loads(msg["case"]), int(msg["stage"]))
