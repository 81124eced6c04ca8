"""The observation list (``harness.observation.OBSERVATIONS``) and what each
path holds to it: None versus zeros is a finding, and a contract that is
blind to an observation says why."""

from __future__ import annotations

import copy
import types

import pytest

import torch

from harness.case.spec import Case, Input, Node, Param, Schedule, Use
from harness.compare.values import compare
from harness.engine.check import check
from harness.observation import GRAD_NONE, OBSERVATIONS
from harness.paths import families
from harness.paths.split.paths import SplitPath
from oracles import split_fixed
from oracles.eager import observe


def _unused_case() -> Case:
    """``x0 @ w0`` beside a trainable ``u1`` that never reaches the output: eager leaves ``u1.grad`` None."""
    return Case(params=(Param("w0", (3, 3)), Param("u1", (3, 3))),
                inputs=(Input("x0", (2, 3), requires_grad=True),),
                nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))),), outputs=(Use("n0"),),
                schedule=Schedule(microbatches=2))


def _split_with(weight) -> SplitPath:
    path = SplitPath("split.probe", "unused", stock_contract=False)
    path._impl = types.SimpleNamespace(stage_backward_input=split_fixed.stage_backward_input,
                                       stage_backward_weight=weight)
    return path


def test_a_zero_grad_where_eager_leaves_none_is_a_finding():
    def materializing(weights, groups, retain_graph=False):
        weights = list(weights)
        before = split_fixed.stage_backward_weight(weights, groups, retain_graph)
        for w in weights:
            if w.requires_grad and w.grad is None:
                w.grad = torch.zeros_like(w)  # the bucket-style "every parameter gets a grad"
        return before

    found = check(_unused_case(), _split_with(materializing))
    assert [d.param for d in found] == ["u1"], found
    assert "u1 is None in eager, a zero tensor on split.probe" in found[0].detail


def test_none_where_eager_has_a_zero_grad_is_a_finding_unless_the_contract_is_blind_to_it():
    case = _unused_case()
    oracle = observe(case)
    zeros = copy.deepcopy(oracle)
    for step in zeros.steps:
        step.grads["u1"] = torch.zeros(3, 3, dtype=torch.float64)
    zeros.path = "probe"
    found = compare(case, zeros, oracle)
    assert [d.param for d in found] == ["u1"] and "a zero tensor in eager, None on oracle" in found[0].detail
    assert compare(case, zeros, oracle, blind=frozenset({GRAD_NONE})) == []


def test_every_declared_blind_spot_names_an_observation_and_a_reason():
    from harness.paths import resolve

    for path in resolve(None):
        for name, why in path.contract.blind_spots():
            assert name in OBSERVATIONS, (path.name, name)
            assert len(why) > 20, (path.name, name, why)


@pytest.mark.parametrize("family", [f.name for f in families()])
def test_a_family_makes_every_observation_its_contract_does_not_declare_blind(family):
    """The probe (``harness.engine.probe``) shows which observations a path
    made. One it skips, or whose trigger its contract refuses, without
    declaring it blind is the silent blind spot the observation contract exists to prevent. (A blind
    one may still be made: split records retained grads that compare, by
    its contract, does not hold it to.)"""
    from harness.engine.probe import kinds, survey

    paths = kinds(family)
    if not paths:
        pytest.skip(f"no {family} path is available here")
    silent = [(path.name, name, status) for path in paths for name, status in survey(path).items()
              if status not in ("made", "blind")]
    assert not silent, silent


def test_contract_flags_and_blind_spots_agree():
    """A switch that is off implies its blind spot (``Contract.blind_spots``);
    one that is on promises the observation, so no family declares it blind."""
    from harness.observation import LAYOUT, LIFETIME, RETAINED
    from harness.paths import resolve

    for path in resolve(None):
        c, blind = path.contract, path.contract.blind_to()
        assert (RETAINED in blind) == (not c.retained_grads or not c.tensor_hooks), path.name
        assert (LAYOUT in blind) == (not c.grad_layout), path.name
        assert (LIFETIME in blind) == (not c.graph_freed), path.name


def test_the_rng_state_is_recorded_and_compared_where_the_contract_is_not_blind_to_it():
    """A case with dropout: every path not blind to the RNG state records it
    after each backward, equal to the oracle's; one random number more in a
    backward is a finding."""
    from harness.observation import RNG_STATE
    from harness.paths import resolve

    case = _unused_case()
    case = Case(**{**case.__dict__, "nodes": case.nodes + (Node("n1", "dropout", (Use("n0"),)),),
                   "outputs": (Use("n1"),)})
    oracle = observe(case)
    assert all(s.rng is not None for s in oracle.steps)
    seen = []
    for path in resolve("eager.accumulate,split.fixed,checkpoint.fixed,compile.aot_eager"):
        if RNG_STATE in path.contract.blind_to() or path.supports(case) is not None:
            continue
        obs = path.run(case)
        assert [s.rng for s in obs.steps] == [s.rng for s in oracle.steps], path.name
        assert check(case, path) == [], path.name
        seen.append(path.name)
    assert seen == ["eager.accumulate", "split.fixed", "checkpoint.fixed"]

    def draws_in_backward(weights, groups, retain_graph=False):
        torch.rand(())  # say, a stochastic-rounding buffer drawn from the global generator
        return split_fixed.stage_backward_weight(weights, groups, retain_graph)

    found = check(case, _split_with(draws_in_backward))
    assert [(d.kind, d.microbatch) for d in found] == [("rng", 0)], found


def test_a_grad_only_the_path_has_is_compared():
    """compare walks the path's names too: an oracle that dropped a retained
    grad (mutant 110 of oracles/eager.py survived every path)
    shows as a finding, not as nothing to compare."""
    case = Case(**{**_unused_case().__dict__, "retain_grad": ("n0",)})
    oracle = observe(case)
    assert all(s.retained.get("n0") is not None for s in oracle.steps)
    path = copy.deepcopy(oracle)
    path.path = "probe"
    for step in oracle.steps:
        step.retained.pop("n0")
    found = compare(case, oracle, path)
    assert [(d.param, d.microbatch) for d in found] == [("retained grad n0", 0)], found
    assert "where autograd gives none" in found[0].detail


def test_an_oracle_without_the_rng_state_is_a_harness_error():
    """Both sides record the RNG state exactly when the case draws random
    numbers; an oracle that stops recording it (mutant 86) would otherwise
    compare nothing and pass."""
    case = _unused_case()
    case = Case(**{**case.__dict__, "nodes": case.nodes + (Node("n1", "dropout", (Use("n0"),)),),
                   "outputs": (Use("n1"),)})
    oracle = observe(case)
    path = copy.deepcopy(oracle)
    path.path = "probe"
    for step in oracle.steps:
        step.rng = None
    with pytest.raises(RuntimeError, match="oracle recorded no RNG state"):
        compare(case, oracle, path)
