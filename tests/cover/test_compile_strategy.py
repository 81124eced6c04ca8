"""The compile family's own draw: structures dense in OpInfo ops, picked by
how Inductor handles each (decomposed, lowered, fallback), placed among the
core case's tied and transposed uses, and compiled whole."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, seed as hseed, settings

from harness.case import opinfo
from harness.case.spec import Case, Hook, Input, Node, Param, Schedule, Use
from harness.case.validate import infer_shapes
from harness.engine.runner import check
from harness.engine.target import Target
from harness.paths.compile import data as compile_data, lowering
from harness.paths.compile.flavors import DEVICE_CONTRACT, FLAVORS
from harness.paths.compile.paths import CompilePath

pytestmark = pytest.mark.skipif(not lowering.entries() or not opinfo.keys(),
                                reason=f"no op or lowering table for torch {opinfo.version_key()}")


def _base(retain: bool = False) -> Case:
    """x0 @ w0 @ w0.T with a hook: a tied weight used plain and transposed, two microbatches."""
    return Case(
        params=(Param("w0", (3, 3)),),
        inputs=(Input("x0", (2, 3), requires_grad=True),),
        nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))), Node("n1", "matmul", (Use("n0"), Use("w0", transpose=True)))),
        outputs=(Use("n1"),), hooks=(Hook("n0", "scale", 2),), retain_grad=("n1",) if retain else (),
        schedule=Schedule(microbatches=2), exact=True, seed=3)


def _draws(contract, n: int, seed: int = 1) -> list[Case]:
    target = Target([CompilePath(FLAVORS["compile.aot_eager"])], seed=seed)
    target.paths[0].contract = contract
    out: list[Case] = []

    @hseed(seed)
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(target.strategy())
    def draw(case: Case) -> None:
        out.append(case)

    draw()
    return out


def test_every_drawable_op_has_a_class_and_graph_breakers_are_left_out():
    entries = lowering.entries()
    assert set(opinfo.keys()) <= set(entries)
    pools = dict(lowering.pools())
    assert set(pools) == set(lowering.CLASSES)
    drawn = [k for keys in pools.values() for k in keys]
    assert len(drawn) == len(set(drawn)) >= 500
    breaking = {k for k, (_, why) in entries.items() if why}
    assert {"masked_select", "corrcoef"} <= breaking and not breaking & set(drawn)
    assert set(drawn) | breaking >= set(opinfo.keys())
    assert lowering.classes()["addmv"] == "decomposed" and lowering.classes()["__rmul__:method"] == "lowered"


def test_a_pick_is_a_hash_of_the_drawn_value_in_its_slots_class():
    assert compile_data.pick(0, 0) is None
    assert compile_data.pick(3, 12345) == compile_data.pick(3, 12345)
    classes = lowering.classes()
    for slot in range(len(compile_data.PATTERN)):
        key, i = compile_data.pick(slot, 1 + slot)
        assert classes[key] == compile_data.PATTERN[slot] and 0 <= i < len(opinfo.table()[key]["samples"])
    # neighbouring values land on unrelated ops: the shrinker and Hypothesis's small values repeat less
    assert len({compile_data.pick(0, v)[0] for v in range(1, 41)}) >= 30
    # and another flavour's salt sends Hypothesis's favourite values to other ops
    a, b = (compile_data.salt_of(f) for f in ("compile.aot_eager", "compile.autograd"))
    assert sum(compile_data.pick(0, v, a) != compile_data.pick(0, v, b) for v in (1, 2, 3, 2**32 - 1)) >= 3


@pytest.mark.parametrize("width", [1, 2, 3])
def test_inserted_ops_sit_between_the_core_uses_and_the_case_stays_plain_data(width):
    base = _base()
    ops = [compile_data.pick(s, 77 + s) for s in range(5)]
    case = compile_data.insert_ops(base, [(1, *ops[0]), (1, *ops[1]), (0, *ops[2]), (0, *ops[3]), (0, *ops[4])], width)
    infer_shapes(case)
    assert not case.exact and case.hooks == base.hooks and case.params == base.params
    assert Case.from_json(json.loads(case.dumps())) == case
    names = [n.name for n in case.nodes]
    assert len(names) == len(set(names))
    kinds = Counter(n.op for n in case.nodes)
    assert kinds["opinfo"] == 5 and kinds["add"] == {1: 0, 2: 2, 3: 3}[width]
    # n0's later use (the transposed matmul) and the output read the inserted ops' results
    second = next(n for n in case.nodes if n.op == "matmul" and n.args[1].transpose)
    assert second.args[0].ref != "n0" and case.outputs[0].ref != "n1"
    assert compile_data.insert_ops(base, [], width) == base


def test_compile_targets_draw_hundreds_of_ops_of_every_class_and_a_cuda_flavour_none():
    classes = lowering.classes()
    aot, inductor = FLAVORS["compile.aot_eager"].contract, FLAVORS["compile.inductor"].contract
    for contract, least in ((aot, 180), (inductor, 70)):
        cases = _draws(contract, 100)
        ops = [n.attr("fn") for c in cases for n in c.nodes if n.op == "opinfo"]
        assert len(set(ops)) >= least, (contract.draws[0].args, len(set(ops)))
        assert set(classes[k] for k in ops) == set(lowering.CLASSES)
        assert any(c.exact for c in cases)  # one exact case in four stays exact, without ops
        assert _draws(contract, 100) == cases  # the same seed draws the same cases
    assert all(d.name != "compile" for d in DEVICE_CONTRACT.draws)
    assert FLAVORS["compile.inductor.cuda"].contract is DEVICE_CONTRACT
    assert FLAVORS["compile.dynamic.symbolic"].contract.draws[0].args[0] == compile_data.INDUCTOR_SLOTS
    assert FLAVORS["compile.autograd"].contract.draws[0].args[0] == compile_data.SLOTS


def test_flavours_drawing_one_seed_meet_the_same_structures_with_other_ops():
    """One seed draws the same core cases for every flavour; each flavour's
    salt puts other ops among them, so together they meet more ops."""
    def ops(cases):
        return {n.attr("fn") for c in cases for n in c.nodes if n.op == "opinfo"}

    def core(c):
        return [n for n in c.nodes if n.op != "opinfo"][:2], c.params

    a, b = (_draws(FLAVORS[f].contract, 40) for f in ("compile.aot_eager", "compile.autograd"))
    assert [core(c) for c in a if c.exact] == [core(c) for c in b if c.exact] != []
    assert len(ops(a) | ops(b)) >= 1.6 * len(ops(a))


def test_a_dense_structure_with_retain_grad_compiles_every_op_and_agrees():
    """retain_grad breaks dynamo's graph inside the forward's loop, so each node
    is compiled as a frame of its own, every OpInfo node sharing one code
    object: past dynamo's default recompile limit of 8 its later ops ran eagerly."""
    picks = [compile_data.pick(s, 1000 + 7 * s) for s in range(12)]
    case = compile_data.insert_ops(_base(retain=True), [(s % 2, *p) for s, p in enumerate(picks)], 1)
    assert len({n.attr("fn") for n in case.nodes if n.op == "opinfo"}) > 8
    path = CompilePath(FLAVORS["compile.aot_eager"])
    try:
        assert check(case, path) == []
    finally:
        path.close()
    assert path.stats.limit_fallbacks == 0 and path.stats.graphs > 12


def test_an_op_is_decomposed_if_any_of_its_aten_ops_is_then_fallback_then_lowered():
    assert lowering._summary(["lowered", "fallback"]) == "fallback"
    assert lowering._summary(["fallback", "decomposed", "lowered"]) == "decomposed"
    assert lowering._summary([]) == "lowered"  # a view that dispatches nothing
