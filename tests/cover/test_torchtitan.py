"""The torchtitan family: optional, honest when absent, its CPU adaptation
held to "no gradient changes", and, where torchtitan is installed
(``pip install 'gradfuzz[torchtitan]'``), its parallelize functions really
applied and held to the oracle, with the canary caught."""

import importlib.util
import json
from dataclasses import replace

import pytest
import torch

from harness.case.spec import Case
from harness.case.vocab import SpecError
from harness.paths import resolve
from harness.paths.torchtitan.data import Knobs
from tests.helpers import nested

INSTALLED = importlib.util.find_spec("torchtitan") is not None
needs_torchtitan = pytest.mark.skipif(not INSTALLED, reason="torchtitan is not installed: pip install 'gradfuzz[torchtitan]'")
NAMES = [f"torchtitan.{v}.stock" for v in ("fsdp", "fsdp_ac", "fsdp_sac", "fsdp_compile")]


def test_the_variants_are_listed_and_say_how_to_install_when_absent():
    paths = resolve("torchtitan")
    assert [p.name for p in paths] == NAMES
    for p in paths:
        a = p.availability()
        assert a.ok == INSTALLED and (INSTALLED or "pip install 'gradfuzz[torchtitan]'" in a.reason)


def test_the_knobs_are_case_data_checked_against_the_case():
    case = nested(microbatches=2).with_data("torchtitan", Knobs(reshard="never", layers=(1,), preserve_rng=False))
    assert Case.loads(case.dumps()) == case
    for field, value in (("reshard", "sometimes"), ("layers", [2])):  # nested has 2 nodes: a cut must be 1
        spec = json.loads(case.dumps())
        spec["family"]["torchtitan"][field] = value
        with pytest.raises(SpecError, match=f"torchtitan.{field}"):
            Case.loads(json.dumps(spec))


def test_contract_refuses_what_torchtitan_owns_or_cannot_take():
    fsdp, full, _, compiled = resolve("torchtitan")
    case = nested(microbatches=2)
    assert fsdp.supports(case) is None and compiled.supports(case) is None
    assert "zeroes" in fsdp.supports(replace(case, schedule=replace(case.schedule, zero_grad="keep")))
    assert "float64" in fsdp.supports(replace(case, dtype="float64"))
    assert "powers of two" in fsdp.supports(replace(case, schedule=replace(case.schedule, microbatches=3)))
    assert "fullgraph" in compiled.supports(replace(case, retain_grad=("n0",)))
    assert fsdp.supports(replace(case, retain_grad=("n0",))) is None


def test_a_view_of_a_weight_handed_out_of_its_resharding_unit_is_refused():
    """FSDP2 frees a unit's unsharded weights when its forward ends; a view of
    one read later crashed the ranks (the 10-minute fuzz's one finding)."""
    from harness.case.spec import Input, Node, Param, Schedule, Use

    view = Node("n0", "expand", (Use("g0"),), (("shape", (2, 3)),))
    case = Case(params=(Param("g0", (1, 3)),), inputs=(Input("x0", (2, 3), requires_grad=True),),
                nodes=(view, Node("n1", "mul", (Use("x0"), Use("n0")))), outputs=(Use("n1"),),
                schedule=Schedule(microbatches=2))
    (fsdp,) = resolve("torchtitan.fsdp.stock")
    assert "n0 is a view" in fsdp.supports(case.with_data("torchtitan", Knobs(layers=(1,))))
    assert fsdp.supports(case.with_data("torchtitan", Knobs(reshard="never", layers=(1,)))) is None
    assert fsdp.supports(case) is None  # one block: the view stays inside the unit
    as_output = replace(case, outputs=(Use("n0"), Use("n1")))  # the root reshards after forward too
    assert "n0 is a view" in fsdp.supports(as_output.with_data("torchtitan", Knobs(reshard="never")))


def test_the_gloo_reduce_op_is_premul_sum_of_one_turned_into_a_plain_sum():
    """cpu.adapt's claim, held against FSDP2 itself: with torchtitan's factor 1
    and sums forced, FSDP2 reduces with SUM and divides by nothing, where it
    would otherwise PREMUL_SUM by 1.0: the same values, bit for bit."""
    from torch.distributed import ReduceOp
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

    class Group:
        def size(self) -> int:
            return 2

    pre, post, rs, ar = fc._get_gradient_divide_factors(Group(), None, torch.float32, "cpu", 1.0, True)
    assert (rs, ar) == (ReduceOp.SUM, ReduceOp.SUM) and pre is None and post == 1.0
    t = torch.randn(5)
    before = t.clone()
    fc._div_if_needed(t, post)
    assert torch.equal(t, before)
    # without the switch (as on NCCL) the op is PREMUL_SUM(1 / 1.0), a multiplication by one
    assert fc._get_gradient_divide_factors(Group(), None, torch.float32, "cpu", 1.0, False)[:2] == (None, None)


def test_the_triton_stand_in_only_fills_a_missing_module_and_raises_when_called(monkeypatch):
    import sys

    from harness.paths.torchtitan import cpu

    monkeypatch.delitem(sys.modules, cpu.KERNELS, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else object())
    assert cpu.without_triton() and not cpu.without_triton()  # once
    stub = sys.modules[cpu.KERNELS]
    with pytest.raises(RuntimeError, match="no triton"):
        stub.fill_dispatch_metadata_kernel()
    with pytest.raises(AttributeError):
        stub.__file__  # noqa: B018  (inspect and importlib must not take it for a module with source)


@needs_torchtitan
def test_every_variant_applies_torchtitan_and_agrees_with_the_oracle_on_tied_layers():
    from harness.engine.check import check

    case = nested(microbatches=2).with_data("torchtitan", Knobs(reshard="never", layers=(1,)))
    want = {"fsdp": (0, 0), "fsdp_ac": (2, 0), "fsdp_sac": (2, 0), "fsdp_compile": (0, 2)}
    for p in resolve("torchtitan"):
        assert p.supports(case) is None and check(case, p) == [], p.name
        reply = p.group.request({"op": "call", "module": "harness.paths.torchtitan.rank", "case": case.dumps(),
                                 "ac": p.ac, "compile": p.compiled, "impl": "stock"}, p.timeout).replies[0]
        applied = reply["applied"]
        # two blocks and the root are FSDP units; AC wraps and compile compiles each block
        assert applied["fsdp"] == 3 and (applied["checkpointed"], applied["compiled"]) == want[p.name.split(".")[1]]


@needs_torchtitan
def test_the_canary_is_caught_from_a_cold_start():
    from harness.canaries import all_canaries
    from harness.gate.selfcheck import run_canary

    (canary,) = [c for c in all_canaries() if c.name == "torchtitan_keeps_last_micro_step"]
    result = run_canary(canary, seed=0)
    assert result.caught and "expected g1 + g2" in result.detail, result.detail
