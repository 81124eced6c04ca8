"""The observations the loop records, each shown to fail on a split
implementation broken in exactly that way (and to pass on the fixed one)."""

from __future__ import annotations

import types

import torch

from harness.case.spec import Case, Input, Node, Param, Schedule, Use
from harness.engine.check import check
from harness.paths.eager.paths import EagerAccumulate
from harness.paths.split.paths import SplitPath
from oracles import split_fixed


def _case(**kw) -> Case:
    params = kw.pop("params", (Param("w0", (3, 3)),))
    return Case(params=params, inputs=(Input("x0", (2, 3), requires_grad=True),),
                nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))),), outputs=(Use("n0"),),
                schedule=kw.pop("schedule", Schedule(microbatches=2)), **kw)


def _impl(weight=None, input_=None) -> types.SimpleNamespace:
    return types.SimpleNamespace(stage_backward_input=input_ or split_fixed.stage_backward_input,
                                 stage_backward_weight=weight or split_fixed.stage_backward_weight)


def _split(impl) -> SplitPath:
    path = SplitPath("split.probe", "unused", stock_contract=False)
    path._impl = impl
    return path


def _kinds(case: Case, path) -> dict[str, str]:
    return {d.kind: d.detail for d in check(case, path)}


def test_fixed_split_and_eager_pass_every_new_check():
    frozen = _case(params=(Param("w0", (3, 3)), Param("w1", (3, 3), requires_grad=False), Param("u2", (3, 3))),
                   loss=True)
    frozen = Case(**{**frozen.__dict__, "nodes": frozen.nodes + (Node("n1", "matmul", (Use("n0"), Use("w1"))),),
                     "outputs": (Use("n1"),)})
    for path in (_split(_impl()), EagerAccumulate()):
        assert check(frozen, path) == [], path.name


def test_a_transposed_grad_left_in_dot_grad_is_a_layout_finding():
    def weight(weights, groups, retain_graph=False):
        before = split_fixed.stage_backward_weight(weights, groups, retain_graph)
        for w in weights:
            if w.grad is not None:
                w.grad = w.grad.mT.contiguous().mT  # same values, transposed strides
        return before

    def weights_once(ws, gs, retain_graph=False):
        return weight(list(ws), gs, retain_graph)

    found = _kinds(_case(), _split(_impl(weight=weights_once)))
    assert "layout" in found and "strides (1, 3)" in found["layout"], found


def test_a_frozen_parameter_given_a_grad_is_a_finding():
    def weight(weights, groups, retain_graph=False):
        weights = list(weights)
        before = split_fixed.stage_backward_weight(weights, groups, retain_graph)
        for w in weights:
            if not w.requires_grad:
                w.grad = torch.zeros_like(w)
        return before

    case = _case(params=(Param("w0", (3, 3)), Param("w1", (3, 3), requires_grad=False)))
    case = Case(**{**case.__dict__, "nodes": case.nodes + (Node("n1", "matmul", (Use("n0"), Use("w1"))),),
                   "outputs": (Use("n1"),)})
    assert "frozen" in _kinds(case, _split(_impl(weight=weight)))


def test_a_graph_kept_alive_after_backward_is_a_finding():
    kept = []

    def weight(weights, groups, retain_graph=False):
        kept.extend(g["outputs"] for g in groups)  # a reference the implementation forgot to drop
        return split_fixed.stage_backward_weight(weights, groups, retain_graph=True)

    case = _case()
    case = Case(**{**case.__dict__, "nodes": (Node("n0", "relu", (Use("x0"),)), Node("n1", "matmul", (Use("n0"), Use("w0")))),
                   "outputs": (Use("n1"),)})
    found = _kinds(case, _split(_impl(weight=weight)))
    assert "graph" in found and "still held by its graph" in found["graph"], found


def test_a_leaf_input_grad_never_filled_is_a_finding_on_eager_contracts():
    class NoLeafGrad(EagerAccumulate):
        name = "eager.probe"

        def run(self, case):
            from harness.materialize.schedule import run_schedule

            def backward(outs, cots, inputs, params):
                got = torch.autograd.grad(outs, list(inputs.values()) + list(params.values()), cots)
                for p, g in zip(params.values(), got[len(inputs):]):
                    p.grad = g.clone() if p.grad is None else p.grad + g
                return dict(zip(inputs, got[:len(inputs)]))

            return run_schedule(case, self.name, backward, observe=self.contract.observe())

    found = check(_case(), NoLeafGrad())
    assert any("input grad x0.grad" in d.detail for d in found), [d.detail for d in found]


def test_a_step_that_swaps_the_grad_object_is_a_finding(monkeypatch):
    from dataclasses import replace

    from harness.compare.values import compare
    from oracles.eager import observe

    case = replace(_case(schedule=Schedule(microbatches=1, steps=2, optimizer="sgd", lr=0.1)), dtype="float64")
    oracle = observe(case)
    honest = compare(case, oracle, EagerAccumulate().run(case))
    assert not honest, [d.detail for d in honest]
    step = torch.optim.SGD.step

    def swapping(self, *a, **kw):  # right values, but the user's .grad reference goes stale
        out = step(self, *a, **kw)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad = p.grad.clone()
        return out

    monkeypatch.setattr(torch.optim.SGD, "step", swapping)
    found = compare(case, oracle, EagerAccumulate().run(case))
    assert any("grad object replaced by the step" in d.detail for d in found), [d.detail for d in found]
