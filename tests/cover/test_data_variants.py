"""Data variants (``Contract.data_variants``): one drawn structure, checked with
several data, so a machinery that compiles per structure compiles once for them."""

import dataclasses

from hypothesis import HealthCheck, given, seed, settings

from harness.case.ops import draws_random
from harness.engine.result import Result
from harness.engine.session import fuzz
from harness.engine.target import Target, TargetRun
from harness.paths import resolve
from harness.paths.compile.cache import structure_key
from harness.paths.compile.flavors import CONTRACT as COMPILE_CONTRACT


class Variants:
    """eager.accumulate under a contract that asks for ``k`` data variants."""

    def __init__(self, k: int) -> None:
        self.inner = resolve("eager.accumulate")[0]
        self.name = "eager.accumulate"
        self.contract = dataclasses.replace(self.inner.contract, data_variants=k)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


def _draw(strategy, n: int, at: int = 0) -> list:
    got = []

    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @seed(at)
    @given(strategy)
    def collect(x):
        got.append(x)

    collect()
    return got


def test_the_compile_flavours_ask_for_variants_and_other_paths_do_not():
    assert COMPILE_CONTRACT.data_variants > 1
    assert all(p.contract.data_variants == 1 for p in resolve("eager,split,checkpoint"))


def test_a_one_case_target_draws_exactly_what_its_strategy_draws():
    t = Target(resolve("eager.accumulate"))
    assert t.variants == 1
    assert _draw(t.examples(), 30) == _draw(t.strategy(), 30)


def test_variants_share_the_structure_and_differ_in_data():
    t = Target([Variants(6)])
    groups = _draw(t.examples(), 40, at=3)
    assert all(1 <= len(g) <= 6 for g in groups) and any(len(g) == 6 for g in groups)
    moved = 0
    for first, *rest in groups:
        for v in rest:
            assert structure_key(v) == structure_key(first)
            assert (v.params, v.inputs, v.nodes, v.outputs) == (first.params, first.inputs, first.nodes, first.outputs)
            assert dataclasses.replace(v.schedule, grad_init=first.schedule.grad_init,
                                       zero_grad=first.schedule.zero_grad) == first.schedule
            if draws_random(first):
                assert v.seed == first.seed  # the compiled forward keeps the seed it was built with
            else:
                moved += v.seed != first.seed
            assert t.takes(v)
    assert moved > 0.9 * sum(len(g) - 1 for g in groups if not draws_random(g[0]))


def test_the_budget_counts_drawn_examples_and_the_tallies_count_cases():
    path = Variants(4)
    session = fuzz([path], examples=5, seed=0)
    tally = session.result.paths["eager.accumulate"]
    run = session.runs[0]
    assert run.drawn == 5
    assert tally.per_example == 4
    assert 5 < tally.examples <= 20 and tally.examples == tally.run + sum(tally.skipped.values())
    again = fuzz([Variants(4)], examples=5, seed=0).result.paths["eager.accumulate"]
    assert again.examples == tally.examples  # same seed and budget, same counts


def test_a_variant_that_diverges_is_the_case_reported():
    """A bug only some data show: the finding is the variant's case, shrunk, not the drawn one."""

    class WrongOnPrefilled(Variants):
        def run(self, case):
            obs = self.inner.run(case)
            if case.schedule.grad_init == "prefilled":
                for step in obs.steps:
                    step.grads = {n: None if g is None else g * 2 for n, g in (step.grads or {}).items()}
            return obs

    result = Result()
    target = Target([WrongOnPrefilled(8)], seed=0)
    run = TargetRun(target, result, examples=20)
    found = run.run()
    assert found and not found[0].flaky
    assert found[0].case.schedule.grad_init == "prefilled"
