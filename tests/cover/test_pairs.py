"""Pairwise draws: the pair measurement of
``benchmarks/pairs.py`` on known cases, and the generator's pair targets
(``harness.generate.focus``) holding coverage and contract waste where they
were measured."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from harness.case.spec import Case, Hook, Node, Param, Schedule, Use
from harness.engine.session import plan
from harness.generate import MOSTLY, cases
from harness.paths import Options, close_paths, resolve
from tests.helpers import benchmark_module, nested

pairs = benchmark_module("pairs")


def test_features_of_a_known_case():
    case = nested(microbatches=2)  # x0 @ w0 @ w0: matmul, w0 tied, exact, 2 microbatches
    f = pairs.features(case)
    assert f["op"] == {"matmul"}
    assert f["schedule"] == {"mode=exact", "microbatches=2", "steps=1", "grad_init=none", "tied"}
    assert f["training"] == {"zero_grad=set_to_none"}
    assert f["knob"] == set()
    # 1 op x 5 schedule + 1 op x 1 training + 5 schedule x 1 training; no knob, no pair within a class
    got = pairs.pairs_of(f)
    assert len(got) == 11
    assert ("op:matmul", "schedule:tied") in got
    assert not any(a.split(":")[0] == b.split(":")[0] for a, b in got)


def test_features_see_transposes_hooks_training_and_family_data():
    case = nested()
    case = replace(case, nodes=(case.nodes[0], Node("n1", "matmul", (Use("n0"), Use("w0", transpose=True)))),
                   hooks=(Hook("n0", "scale", 2),), retain_grad=("n0",),
                   schedule=Schedule(steps=2, zero_grad="keep", optimizer="adam", clip="2"), dtype="float64")
    case = case.with_data("torchtitan", None)
    f = pairs.features(case, ("torchtitan",))  # absent: read as its defaults
    assert "transposed" in f["schedule"] and "steps=2" in f["schedule"]
    assert {"hook=scale", "retain_grad", "optimizer=adam", "optimizer_impl=default", "clip=2",
            "zero_grad=keep"} <= f["training"]
    assert {"torchtitan.reshard=default", "torchtitan.layers#=0", "torchtitan.preserve_rng=True"} <= f["knob"]


def test_rules_exclude_what_the_generator_cannot_draw():
    assert pairs.excluded(("op:attention", "schedule:mode=exact"))
    assert pairs.excluded(("schedule:mode=tolerance", "training:optimizer=rprop"))
    assert pairs.excluded(("op:attention", "schedule:mode=tolerance")) is None
    assert pairs.excluded(("op:embedding", "schedule:mode=exact")) is None
    assert pairs.excluded(("knob:placement:shard0", "op:index"))  # the placements draw keeps to_local there
    assert pairs.excluded(("knob:placement:shard0", "op:matmul")) is None


@pytest.fixture(scope="module")
def eager_split():
    ps = resolve("eager,split", Options())
    try:
        (target,) = plan(ps, exact=None, seed=0)
        yield target
    finally:
        close_paths(ps)


def _x_grad_share(input_grad) -> float:
    got: list[bool] = []

    @settings(max_examples=200, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @seed(0)
    @given(cases(model=True, input_grad=input_grad))
    def one(case: Case) -> None:
        got.append(case.inputs[0].requires_grad)

    one()
    return sum(got) / len(got)


def test_mostly_draws_input_grads_three_times_in_four():
    # split.stock needs an input that requires grad, eager does not: their shared target asks for MOSTLY.
    assert _x_grad_share(MOSTLY) > 0.65 > _x_grad_share(False)
    assert _x_grad_share(True) == 1.0


@settings(max_examples=150, deadline=None, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
@seed(0)
@given(st.data())
def test_a_contract_without_tensor_hooks_draws_none(data):
    """torchtitan.fsdp_compile (fullgraph=True) refused 72% of the draws it
    shared with the other FSDP paths, nearly all for a hook or retain_grad;
    ``Contract.tensor_hooks=False`` gives it a target that draws neither,
    and the same draw with hooks on does make them."""
    from harness.paths.base import Contract

    flags = dict(Contract(model_parts=True, tensor_hooks=False).strategy_flags())
    assert flags["hooks"] is False
    case = data.draw(cases(**flags))
    assert not case.hooks and not case.retain_grad


def test_the_hook_targets_are_drawn_where_hooks_are_allowed():
    got = []

    @settings(max_examples=150, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @seed(0)
    @given(cases(model=True))
    def one(case: Case) -> None:
        got.append(bool(case.hooks or case.retain_grad))

    one()
    assert sum(got) > 30, sum(got)


def test_pairs_at_200_examples_above_the_old_generator(eager_split):
    """Measured on 7cfa862 (before pair targets): 407 distinct cross-class pairs
    in the first 200 eager+split examples at seed 0, split.stock outside its
    contract in 65% of them; with pair targets 515 and 29%."""
    row = pairs.measure(eager_split, 200, 0)
    assert row["covered"] >= 470, row["covered"]
    assert row["out_of_contract"]["split.stock"]["skipped_percent"] <= 45
    for rare in ("training:retain_grad", "training:hook=observe", "op:attention", "op:loss"):
        assert rare in {x for p in row["feasible_pairs"] for x in p}, rare


def test_the_same_seed_draws_the_same_cases(eager_split):
    a, b = pairs.draw(eager_split, 60), pairs.draw(eager_split, 60)
    assert [c.dumps() for c in a.cases] == [c.dumps() for c in b.cases]


@settings(max_examples=60, deadline=None, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
@seed(0)
@given(cases(model=True, gaps=True, input_grad=MOSTLY))
def test_pair_targeted_cases_round_trip(case: Case):
    assert Case.loads(case.dumps()) == case


def test_repair_resets_the_grad_state_only_when_that_is_taken():
    from harness.generate import repair

    case = replace(nested(), schedule=Schedule(microbatches=2, steps=2, grad_init="prefilled", zero_grad="keep"))
    fresh = repair(case, lambda c: c.schedule.grad_init == "none" and c.schedule.zero_grad != "keep")
    assert (fresh.schedule.grad_init, fresh.schedule.zero_grad) == ("none", "set_to_none")
    assert fresh.schedule.microbatches == 2 and fresh.nodes == case.nodes  # nothing else moves
    assert repair(case, lambda c: False) is case  # not taken either way: left for the filter


@settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_dtensor_placements_keep_to_local_where_dtensor_refuses(data):
    from harness.generate import dtensor_placements

    base = nested()
    emb = replace(base, params=base.params + (Param("e1", (4, 3)),),
                  nodes=base.nodes + (Node("n2", "embedding", (Use("e1"),), (("idx", (0, 1)),)),
                                      Node("n3", "add", (Use("n1"), Use("n2")))),
                  outputs=(Use("n3"),))
    got = data.draw(dtensor_placements(emb))
    assert all(p.placement == "" for p in got.params)
