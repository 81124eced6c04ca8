"""Cutting a case into pipeline stages: plain data in, ``nn.Module`` stages out.

A family's cuts (the pipeline's stage cuts, the checkpoint regions) list positions in the node list: a cut at ``i`` puts
``nodes[i]`` at the start of a new stage. Nothing else is drawn, so the
shrinker moves a cut by changing one integer and merges two stages by
dropping one. Everything about a stage follows from the cuts:

- a stage's *inputs* are the values defined before it (case inputs and
  earlier nodes, one per result of a multi-output node) that it or a later
  stage uses; the first stage's inputs are the case's inputs, in order;
- a stage's *outputs* are the next stage's inputs, and the last stage's are
  the case's outputs. So a value used two stages later passes through the
  stage between (an output that *is* its input), a result of ``chunk`` or
  ``reshape`` crosses as the view it is, and a stage can return one value
  together with another computed from it;
- a stage *owns* a copy of every parameter its nodes use. A parameter used
  in two stages (a tied weight across the pipeline) has one copy per stage,
  as pipeline users tie weights, and its grad is the sum of the copies'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from harness.case.ops import OPS
from harness.case.spec import Case, Node, Use
from harness.materialize.names import attribute
from harness.materialize.tensors import Built

MAX_STAGES = 4


@dataclass(frozen=True)
class Value:
    """A tensor that can cross a stage boundary: an input, or one result of a node."""

    ref: str
    index: int | None = None

    @property
    def label(self) -> str:
        return self.ref if self.index is None else f"{self.ref}[{self.index}]"


@dataclass(frozen=True)
class StageSpec:
    index: int
    nodes: tuple[Node, ...]
    inputs: tuple[Value, ...]
    outputs: tuple[Use, ...]
    params: tuple[str, ...]


def bounds(case: Case, cuts: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[start, end)`` of each span of ``case.nodes`` between ``cuts``."""
    edges = [0, *cuts, len(case.nodes)]
    return [(edges[i], edges[i + 1]) for i in range(len(edges) - 1)]


def cut(case: Case, cuts: tuple[int, ...]) -> list[StageSpec]:
    params = {p.name for p in case.params}
    order = {x.name: i for i, x in enumerate(case.inputs)}
    order.update({n.name: len(case.inputs) + i for i, n in enumerate(case.nodes)})
    spans = bounds(case, cuts)
    # Every use of a non-parameter value, by the position of the node that uses it
    # (the case's outputs use them at the very end).
    uses: list[tuple[int, Value]] = []
    for i, node in enumerate(case.nodes):
        uses += [(i, Value(u.ref, u.index)) for u in node.args if u.ref not in params]
    uses += [(len(case.nodes), Value(u.ref, u.index)) for u in case.outputs if u.ref not in params]

    def crossing(start: int) -> tuple[Value, ...]:
        """Values defined before node ``start`` and used at or after it."""
        live = {v for at, v in uses if at >= start and order[v.ref] < len(case.inputs) + start}
        return tuple(sorted(live, key=lambda v: (order[v.ref], -1 if v.index is None else v.index)))

    specs = []
    for j, (a, b) in enumerate(spans):
        nodes = case.nodes[a:b]
        inputs = tuple(Value(x.name) for x in case.inputs) if j == 0 else crossing(a)
        if j == len(spans) - 1:
            outputs = case.outputs
        else:
            outputs = tuple(Use(v.ref, index=v.index) for v in crossing(b))
        used = [u.ref for n in nodes for u in n.args] + [u.ref for u in outputs]
        owned = tuple(p.name for p in case.params if p.name in used)
        specs.append(StageSpec(j, nodes, inputs, outputs, owned))
    return specs


class StageModule(torch.nn.Module):
    """One stage: its nodes as plain torch code over its own parameters.

    ``forward`` takes the stage's inputs positionally and returns its
    outputs: one tensor, or a tuple when there are several.
    """

    def __init__(self, case: Case, spec: StageSpec, values: dict[str, torch.Tensor], device: Any = "cpu") -> None:
        super().__init__()
        self.spec = spec
        dtype = getattr(torch, case.dtype)
        frozen = {p.name for p in case.params if not p.requires_grad}
        for n in spec.params:
            self.register_parameter(attribute(n), torch.nn.Parameter(values[n].to(device, dtype),
                                                                     requires_grad=n not in frozen))
        self.hooks = {h.node: h for h in case.hooks}

    @property
    def weights(self) -> dict[str, torch.nn.Parameter]:
        """This stage's parameters by case name (registered under ``names.attribute``)."""
        return {n: getattr(self, attribute(n)) for n in self.spec.params}

    def forward(self, *args: torch.Tensor) -> Any:
        spec = self.spec
        if len(args) != len(spec.inputs):
            raise TypeError(f"stage {spec.index} takes {len(spec.inputs)} inputs, got {len(args)}")
        received = {(v.ref, v.index): t for v, t in zip(spec.inputs, args)}
        weights = self.weights
        local: dict[str, Any] = {}

        def get(u: Use) -> torch.Tensor:
            if u.ref in weights:
                t = weights[u.ref]
            elif u.ref in local:
                t = local[u.ref] if u.index is None else local[u.ref][u.index]
            else:
                t = received[(u.ref, u.index)]
            return t.mT if u.transpose else t

        for node in spec.nodes:
            out = OPS[node.op].run([get(u) for u in node.args], dict(node.attrs))
            if isinstance(out, list):
                out = tuple(out)
            local[node.name] = out
            h = self.hooks.get(node.name)
            if h is not None and isinstance(out, torch.Tensor) and out.requires_grad:
                factor = h.factor
                out.register_hook((lambda g, f=factor: g * f) if h.kind == "scale" else (lambda g: None))
        outs = tuple(get(u) for u in spec.outputs)
        return outs[0] if len(outs) == 1 else outs


def examples_of(built: Built, specs: list[StageSpec], device: torch.device) -> dict[int, dict[str, tuple]]:
    """Every stage's ``input_args`` and ``output_args``: microbatch 0 run
    through the stages in order, on parameters of their own, each tensor a
    fresh leaf that requires grad where the real one does. A stage built
    with them skips the schedule's metadata inference, which runs each
    later stage's forward on inputs it makes up (zeros, or memory it did
    not fill) and raises where an op checks its values."""
    case = built.case
    values = built.params()  # drawn afresh: the stages' own parameters are not touched
    drawn = built.inputs(0)
    args: tuple = tuple(drawn[x.name].to(device, built.dtype).requires_grad_(x.requires_grad) for x in case.inputs)
    examples = {}
    for spec in specs:
        out = StageModule(case, spec, values, device)(*args)
        outs = out if isinstance(out, tuple) else (out,)
        examples[spec.index] = {"input_args": tuple(_leaf(a) for a in args), "output_args": tuple(_leaf(o) for o in outs)}
        args = outs
    return examples


def _leaf(t: Any) -> Any:
    return t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t


def requires_grad(case: Case) -> dict[str, bool]:
    """Which values require grad (by name; a multi-output node counts once),
    statically, from frozen parameters and inputs without grad."""
    need = {p.name: p.requires_grad for p in case.params}
    need.update({x.name: x.requires_grad for x in case.inputs})
    for node in case.nodes:
        need[node.name] = any(need[u.ref] for u in node.args)
    return need
