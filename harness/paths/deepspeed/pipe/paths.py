"""``deepspeed.pipe.stock`` (ZeRO 0) and ``deepspeed.pipe.zero1``: the case
cut into two pipeline stages over the two ranks, as a DeepSpeed
``PipelineModule`` with ``TiedLayerSpec`` for the parameters both stages
use, trained with ``engine.train_batch`` over the case's microbatches
(``piperank`` has what a rank does).

Grads are compared at the end of each ``train_batch`` (the schedule
interleaves a batch's microbatches), read where each parameter lives; a
tied parameter's two copies must agree after DeepSpeed's all-reduce, and
their common value is compared. Outputs are what the loss function was
handed, per microbatch. Input grads are not observable: the engine hands
the first stage detached copies of the inputs.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

from hypothesis import strategies as st

from harness import registry
from harness.case.ops import draws_random
from harness.case.spec import Case
from harness.generate import Draw
from harness.materialize.stages import Value, requires_grad
from harness.materialize.tensors import Built
from harness.observation import INPUT_GRAD, Observation
from harness.paths.assemble import observation as assemble
from harness.paths.base import Availability, Contract, Options, Repro
from harness.paths.deepspeed.paths import BLIND, engine_refusal
from harness.paths.deepspeed.pipe.stages import cut_of
from harness.paths.pooled import PooledPath

GAS = (1, 2, 3, 4)


@st.composite
def _two_stages(draw: Any, case: Case) -> Case:
    """One cut (two stages, one a rank) and the accumulation steps; the cut
    shrinks towards the first node, the steps towards one."""
    space = registry.namespace("pipeline")
    steps = draw(st.sampled_from([g for g in GAS if not case.exact or g & (g - 1) == 0]))
    case = replace(case, schedule=replace(case.schedule, microbatches=steps))
    if space is None or len(case.nodes) < 2:
        return case
    at = draw(st.integers(1, len(case.nodes) - 1))
    return case.with_data("pipeline", space.cls((at,)))


STAGES = Draw("deepspeed.pipe", (_two_stages,))


def _differentiated(case: Case, need: dict[str, bool]) -> set[tuple[str, int | None]]:
    """Values (ref, result index) that reach an output needing grad through
    nodes that need grad: those get a grad in backward."""
    live = {(u.ref, u.index) for u in case.outputs if need[u.ref]}
    reached = {u.ref for u in case.outputs if need[u.ref]}
    for node in reversed(case.nodes):
        if node.name in reached and need[node.name]:
            for u in node.args:
                if need[u.ref]:
                    live.add((u.ref, u.index))
                    reached.add(u.ref)
    return live


def _non_contiguous(case: Case, values: tuple[Value, ...]) -> str | None:
    """The first of ``values`` that one eager forward of the case gives as a non-contiguous tensor."""
    import torch

    built = Built(case)
    env: dict[str, Any] = {**built.params(), **built.inputs(0)}
    with torch.no_grad():
        built.run_span(env, 0, len(case.nodes))
    for v in values:
        t = env[v.ref] if v.index is None else env[v.ref][v.index]
        if isinstance(t, torch.Tensor) and not t.is_contiguous():
            return v.label
    return None


def refusal(case: Case) -> str | None:
    """What the pipeline engine cannot express, or None."""
    data = case.data("pipeline")
    if data is None or len(data.cuts) != 1:
        return "the pipeline engine runs here with two stages, one a rank: the case needs exactly one stage cut"
    specs = cut_of(case)
    trainable = {p.name for p in case.params if p.requires_grad}
    if any(not trainable & set(spec.params) for spec in specs):
        return ("a stage without a trainable parameter: the engine steps an optimizer on every stage, and torch's "
                "optimizers refuse an empty parameter list")
    need = requires_grad(replace(case, inputs=tuple(replace(x, requires_grad=False) for x in case.inputs)))
    if not any(need[u.ref] for u in case.outputs):
        return "no output requires grad: the engine's loss has nothing to train"
    for u in specs[0].outputs:
        if not need[u.ref]:
            return (f"{u.ref} crosses the stage boundary without requiring grad (the engine hands the first stage "
                    "detached inputs and backpropagates every floating activation)")
    loose = _non_contiguous(case, specs[1].inputs)
    if loose is not None:
        return (f"{loose} crosses the stage boundary as a non-contiguous view: the engine sends activations as "
                "they are and torch.distributed sends only contiguous tensors (it raises on the first stage and the "
                "second waits forever); a user adds .contiguous()")
    live = _differentiated(case, need)
    for v in specs[1].inputs:
        if (v.ref, v.index) not in live:
            return (f"{v.label} crosses the stage boundary but gets no grad in the second stage (the engine asserts "
                    "every floating activation it received has one)")
    return None


class DeepSpeedPipePath(PooledPath):
    # Each stage accumulates its microbatches through eager's AccumulateGrad:
    # where plain .backward() already diverges (accumulategrad-steals-views
    # over two microbatches), so does the engine.
    contract = Contract(retained_grads=False, draws=(STAGES,), model_parts=True, leaf_input_grads=False,
                        random_ops=False, judged_against="eager.accumulate",
                        blind=(*BLIND, (INPUT_GRAD, "train_batch reads the stage inputs from the data iterator and hands "
                                                    "no input grad back")))

    # Each rank hooks its stage's parameters (``piperank``): a tied weight's
    # grad then never shares a buffer with a sibling's, so the engine's
    # in-place all-reduce of it writes only where it should.
    workarounds = ("clone-grads",)

    def __init__(self, name: str, stage: int, timeout: float = 60.0, backend: str | None = None) -> None:
        super().__init__(name, 2, timeout, backend)
        self.stage = stage

    def availability(self) -> Availability:
        from harness.paths.deepspeed.paths import INSTALL

        if importlib.util.find_spec("deepspeed") is None:
            return Availability(False, f"deepspeed is not installed here: {INSTALL}")
        if registry.namespace("pipeline") is None:
            return Availability(False, "the pipeline family (its stage cuts, family.pipeline) is not installed")
        where = self.group_availability()
        return where if not where.ok else Availability(
            True, f"{where.reason}; DeepSpeed pipeline engine, 2 stages, ZeRO stage {self.stage}")

    def supports(self, case: Case) -> str | None:
        s = case.schedule
        if reason := engine_refusal(case, "after every train_batch"):
            return reason
        if draws_random(case):
            return "dropout: the engine runs the microbatches' forwards on its own RNG stream, one per stage"
        if case.exact and s.microbatches & (s.microbatches - 1):
            return (f"exact mode needs a power of two: the engine divides the loss by the accumulation steps "
                    f"({s.microbatches}), which rounds otherwise")
        if self._world() != 2:
            return "two stages, one a rank: the pipe paths run on two ranks"
        return refusal(case)

    def run(self, case: Case) -> Observation:
        from harness.paths.deepspeed.paths import warm

        warm(self.group)
        outcome = self.group.request({"op": "call", "module": "harness.paths.deepspeed.pipe.rank",
                                      "case": case.dumps(), "stage": self.stage}, self.timeout)
        obs = assemble(self.name, case, _as_replicas(outcome))
        for step in obs.steps:
            step.input_grads = None  # type: ignore[assignment]  # not observable: see the module's doc
        return obs

    def repro(self, case: Case) -> Repro:
        from harness.paths.deepspeed.pipe.script import Pipe

        return Repro(template="deepspeed.pipe", family=Pipe(self.stage))


def _as_replicas(outcome: Any) -> Any:
    """The stages' facts as every rank's: a parameter one stage holds is
    read there and stands for both ranks; a tied one keeps each rank's own
    copy, so the two must agree; outputs are the last stage's."""
    replies = outcome.replies
    ranks = [r for r in sorted(replies) if isinstance(replies[r].get("steps"), list)]
    if len(ranks) < 2:
        return outcome
    n = min(len(replies[r]["steps"]) for r in ranks)
    for i in range(n):
        steps = [replies[r]["steps"][i] for r in ranks]
        merged: dict[str, Any] = {}
        for s in steps:
            for name, enc in s["grads"].items():
                merged.setdefault(name, enc)
        outputs = next((s["outputs"] for s in steps if s["outputs"] is not None), [])
        for s in steps:
            s["grads"] = {**merged, **s["grads"]}
            s["outputs"] = outputs
    return outcome


def paths(options: Options) -> list[DeepSpeedPipePath]:
    timeout = max(options.timeout, 60.0)
    return [DeepSpeedPipePath("deepspeed.pipe.stock", 0, timeout, options.backend),
            DeepSpeedPipePath("deepspeed.pipe.zero1", 1, timeout, options.backend)]


def family_paths(options: Options) -> list[Any]:
    """Every path of the family: the ZeRO engine's, then the pipeline engine's (this module
    imports ``path``, never the other way, so the two do not import each other)."""
    from harness.paths.deepspeed.paths import engine_paths

    return engine_paths(options) + paths(options)
