"""The compile family's float64 dense structures stay within what their term
bounds can judge (``harness.paths.compile.judgeable``): softer samples, then
fewer ops, or no training step where the core alone is past the budget."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, seed as hseed, settings

from harness.case import opinfo
from harness.case.spec import Case, Input, Node, Param, Schedule, Use
from harness.case.validate import infer_shapes
from harness.engine.target import Target
from harness.paths.compile import data as compile_data, judgeable, lowering
from harness.paths.compile.flavors import FLAVORS
from harness.paths.compile.paths import CompilePath

pytestmark = pytest.mark.skipif(not lowering.entries() or not opinfo.keys(),
                                reason=f"no op or lowering table for torch {opinfo.version_key()}")


def _core(dtype: str = "float64") -> Case:
    """x0 @ w0 with an SGD step: a training case, float64 as ``training_steps`` makes it."""
    return Case(params=(Param("w0", (3, 3)),), inputs=(Input("x0", (2, 3)),),
                nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))),), outputs=(Use("n0"),),
                schedule=Schedule(optimizer="sgd", lr=0.1), dtype=dtype, exact=False, seed=5)


def _heavy_chain(dtype: str = "float64", ops: int = 12) -> Case:
    """``_core`` with a chain of the ops that grow the grad bounds most on its 6 elements."""
    drawable = {k for _, keys in lowering.pools() for k in keys}
    heavy = sorted(((k, i) for k, i in opinfo.draws() if k in drawable),
                   key=lambda d: judgeable.growth(opinfo.table()[d[0]]["samples"][d[1]], 6), reverse=True)
    return compile_data.insert_ops(_core(dtype), [(0, k, i) for k, i in heavy[:ops]], 1)


def test_a_heavy_float64_chain_is_brought_within_the_budget_and_stays_valid():
    case = _heavy_chain()
    assert judgeable.peak(case) > judgeable.PEAK_BUDGET
    out = judgeable.gentled(case)
    assert judgeable.peak(out) <= judgeable.PEAK_BUDGET
    infer_shapes(out)
    kept = [n for n in out.nodes if n.op == "opinfo"]
    assert 0 < len(kept) < 12 and out.dtype == "float64" and out.schedule.optimizer == "sgd"
    assert judgeable.gentled(case) == out  # a function of the case: shrinking replays it


def test_a_float32_case_keeps_every_op():
    case = _heavy_chain("float32")
    assert judgeable.gentled(case) is case


def test_a_core_past_the_budget_keeps_its_ops_and_goes_float32_without_its_step():
    case = _heavy_chain(ops=3)
    out = judgeable.gentled(case, budget=1.0)  # the core alone is past 1
    assert out.dtype == "float32" and not out.schedule.optimizer and not out.schedule.clip
    assert out.nodes == case.nodes


def test_the_gentlest_sample_grows_the_bounds_least():
    key = next(k for k in opinfo.keys() if len(opinfo.table()[k]["samples"]) == 2)
    a, b = opinfo.table()[key]["samples"]
    soft = judgeable.gentlest(key, a, 6)
    assert judgeable.growth(soft, 6) == min(judgeable.growth(a, 6), judgeable.growth(b, 6))


def test_drawn_float64_dense_structures_are_within_the_budget():
    target = Target([CompilePath(FLAVORS["compile.aot_eager"])], seed=1)
    target.paths[0].contract = FLAVORS["compile.aot_eager"].contract
    seen = {"float64": 0, "ops": 0}

    @hseed(1)
    @settings(max_examples=60, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(target.strategy())
    def draw(case: Case) -> None:
        if case.exact or case.dtype != "float64":
            return
        seen["float64"] += 1
        seen["ops"] += sum(n.op == "opinfo" for n in case.nodes)
        assert judgeable.peak(case) <= judgeable.PEAK_BUDGET

    draw()
    assert seen["float64"] >= 10 and seen["ops"] >= 5 * seen["float64"], seen


def test_a_dropped_node_is_read_through_to_its_input():
    case = _heavy_chain(ops=2)
    first = next(n for n in case.nodes if n.op == "opinfo")
    out = judgeable._without(case, first.name)
    assert first.name not in {n.name for n in out.nodes}
    assert not any(u.ref == first.name for n in out.nodes for u in n.args)
    held = replace(case, retain_grad=(first.name,))
    assert judgeable._without(held, first.name) is held
