"""``split.*``: each microbatch through ``stage_backward_input`` then ``stage_backward_weight``.

The implementation is any object with those two functions and torch's
signatures: ``split.stock`` is ``torch.distributed.pipelining._backward``,
``split.fixed`` is ``oracles.split_fixed``, and ``--split-impl MODULE[:ATTR]``
puts a team's own fork behind the same checks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from harness.paths.workarounds import IN_PROCESS
from harness.objects import LoadError, Ref, load_object
from harness.observation import RETAINED, Grads, Observation
from harness.materialize.schedule import run_schedule
from harness.paths.base import (NO_RECOMPUTATION, PLAIN_GRADS, Availability, Contract, Options,
                                Repro)
from harness.case.spec import Case

STOCK = "torch.distributed.pipelining._backward"


def _lacks(obj: Any) -> str | None:
    missing = [f for f in ("stage_backward_input", "stage_backward_weight") if not callable(getattr(obj, f, None))]
    return f"lacks {', '.join(missing)}" if missing else None


def load_impl(spec: str) -> Any:
    """``MODULE`` or ``MODULE:ATTR`` -> an object with the two split functions."""
    return load_object(spec, "split implementation", check=_lacks)


class _Workarounds:
    """``impl`` with the external workarounds of known bugs applied: the
    ``split.twin`` path. Fuzzing the twin beside stock keeps a known bug from
    absorbing the budget: a divergence on the twin is one that none of the
    worked-around bugs explains, even where the known bug fires in the same
    case and would give stock's divergence the known signature.

    Each workaround is what a user could do from outside, keyed by the ledger
    id of the bug it removes (``WORKAROUNDS``)."""

    def __init__(self, impl: Any) -> None:
        self.impl = impl

    def stage_backward_input(self, *args: Any, **kwargs: Any) -> Any:
        # Looked up on each call, not bound once: a fix probe the gate puts in
        # force patches the module's function and must reach the twin too.
        return self.impl.stage_backward_input(*args, **kwargs)

    def stage_backward_weight(self, weights: Any, param_groups: Any, retain_graph: bool = False) -> Any:
        weights = list(weights)
        fresh = [w for w in weights if w.grad is None]
        out = self.impl.stage_backward_weight(iter(weights), param_groups, retain_graph=retain_graph)
        for w in fresh:  # split-adopts-aliased-grad: own every grad it adopted
            if w.grad is not None:
                w.grad = w.grad.detach().clone(memory_format=torch.contiguous_format)
        return out


# Ledger ids of the split bugs the twin works around (entries covering
# split.stock only, not the twin: the twin must not show them).
WORKAROUNDS = ("split-adopts-aliased-grad",)


class SplitPath:
    """A split implementation behind the common schedule loop.

    ``stock_contract``: the stock functions need an input that requires
    grad (PipelineStage runs a full backward for the first stage instead,
    because without one the weight groups are never found) and detach the
    stage outputs in place, which autograd refuses for views. Cases outside
    that are not run on it; the fixed implementation takes every case.
    """

    # A pipeline stage hands input grads back (stock never fills a stage
    # input's .grad), so a leaf input's .grad is not part of its promise; the
    # input-only part of the graph legitimately lives as long as the outputs.
    contract = Contract(retained_grads=False, gap_cases=True, model_parts=True, leaf_input_grads=False, graph_freed=True,
                        graph_freed_while_held=False,
                        blind=(NO_RECOMPUTATION, PLAIN_GRADS,
                               (RETAINED, "a split backward runs the shared part of the graph once per pass, so an "
                                "intermediate's retain_grad .grad is not part of a stage's promise")))

    workarounds = IN_PROCESS

    def __init__(self, name: str, impl: str, stock_contract: bool, twin: bool = False) -> None:
        self.name = name
        self.impl_spec = impl
        self.stock_contract = stock_contract
        self.contract = dataclasses.replace(SplitPath.contract, input_grad=stock_contract)
        self.twin = twin
        self._impl: Any = None

    def impl(self) -> Any:
        if self._impl is None:
            loaded = load_impl(self.impl_spec)
            self._impl = _Workarounds(loaded) if self.twin else loaded
        return self._impl

    def with_workaround(self, name: str) -> "SplitPath | None":
        """The twin under this path's name: ``split-clone-adopted`` is what it does."""
        if name != "split-clone-adopted" or self.twin:
            return None
        return SplitPath(self.name, self.impl_spec, self.stock_contract, twin=True)

    def availability(self) -> Availability:
        try:
            self.impl()
        except LoadError as e:
            return Availability(False, str(e))
        return Availability(True, self.impl_spec)

    def supports(self, case: Case) -> str | None:
        if not self.stock_contract:
            return None
        if not any(x.requires_grad for x in case.inputs):
            return "no stage input requires grad (stock expects a full backward for the first stage)"
        if any(_output_is_view(case, i) for i in range(len(case.outputs))):
            return "a stage output is a view (stock detaches outputs in place)"
        return None

    def run(self, case: Case) -> Observation:
        impl = self.impl()

        def backward(outs, cots, inputs, params) -> Grads:
            # As PipelineStage calls it: every stage output (those that need
            # no grad too) with its grad, or a last stage's scalar loss with None.
            outs, grads = _stage_outputs(case, outs, cots)
            dinputs, groups = impl.stage_backward_input(outs, grads, list(inputs.values()), iter(params.values()))
            impl.stage_backward_weight(iter(params.values()), groups)
            return dict(zip(inputs, dinputs))

        return run_schedule(case, self.name, backward, observe=self.contract.observe())

    def repro(self, case: Case) -> Repro:
        imports = Ref.parse(self.impl_spec).import_line("split_impl")
        if self.twin:
            imports += ("\n\n\nclass _Twin:  # the known bugs' workarounds (harness.paths.split._Workarounds)\n"
                        "    def __init__(self, impl):\n"
                        "        self.impl, self.stage_backward_input = impl, impl.stage_backward_input\n\n"
                        "    def stage_backward_weight(self, weights, groups, retain_graph=False):\n"
                        "        weights = list(weights)\n"
                        "        fresh = [w for w in weights if w.grad is None]\n"
                        "        out = self.impl.stage_backward_weight(iter(weights), groups, retain_graph=retain_graph)\n"
                        "        for w in fresh:\n"
                        "            if w.grad is not None:\n"
                        "                w.grad = w.grad.detach().clone(memory_format=torch.contiguous_format)\n"
                        "        return out\n\n\n"
                        "split_impl = _Twin(split_impl)")
        if case.loss:
            call = ("    loss = sum((o * c).sum() for o, c in zip(outs, cots) if o.requires_grad)  # the last stage's loss\n"
                    "    dinputs, groups = split_impl.stage_backward_input(\n"
                    "        [loss], None, list(inputs.values()), iter(params.values()))\n")
        else:
            call = ("    dinputs, groups = split_impl.stage_backward_input(\n"
                    "        outs, cots, list(inputs.values()), iter(params.values()))\n")
        return Repro(imports=imports, backward=call + "    split_impl.stage_backward_weight(iter(params.values()), groups)\n")


def _stage_outputs(case: Case, outs: list, cots: list) -> tuple[list, list | None]:
    if not case.loss:
        return list(outs), list(cots)
    live = [(o * c).sum() for o, c in zip(outs, cots) if o.requires_grad]
    return ([sum(live[1:], live[0])] if live else []), None


VIEW_OPS = {"transpose", "reshape", "chunk"}


def _output_is_view(case: Case, i: int) -> bool:
    use = case.outputs[i]
    if use.transpose:
        return True
    node = next((n for n in case.nodes if n.name == use.ref), None)
    return node is not None and node.op in VIEW_OPS


def paths(options: Options) -> list[SplitPath]:
    """Stock (with ``--split-impl``, the user's fork), its twin and the fixed reference."""
    impl = options.impl("split_impl") or STOCK
    return [SplitPath("split.stock", impl, stock_contract=True),
            SplitPath("split.twin", impl, stock_contract=True, twin=True),
            SplitPath("split.fixed", "oracles.split_fixed", stock_contract=False)]
