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
TP = "torchtitan.tp.stock"


def test_the_variants_are_listed_and_say_how_to_install_when_absent():
    paths = resolve("torchtitan")
    assert [p.name for p in paths] == NAMES + [TP]
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
    fsdp, full, _, compiled, _ = resolve("torchtitan")
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
    for p in [p for p in resolve("torchtitan") if p.name in NAMES]:
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


# --- torchtitan.tp.stock: torchtitan's own Llama under its TP/SP plan -----------------


def _tp_case(microbatches: int = 2, **knobs) -> Case:
    return nested(microbatches=microbatches).with_data("torchtitan", Knobs(**knobs))


def test_the_llama_knobs_are_case_data_checked_for_two_tp_ranks():
    case = _tp_case(heads=4, kv_heads=2, head_dim=4, n_layers=2, vocab=12, tie=True, sp=False,
                    loss_parallel=False, seq=6, batch=2, ignored=5, seed=7)
    assert Case.loads(case.dumps()) == case
    for field, value, words in (("heads", 3, "multiple of 2"), ("head_dim", 3, "multiple of 2"),
                                ("kv_heads", 8, "must divide heads"), ("ignored", 6, "must leave a label"),
                                ("seq", 5, "with sequence parallel the sequence length")):
        spec = json.loads(case.dumps())
        spec["family"]["torchtitan"][field] = value
        spec["family"]["torchtitan"]["sp"] = field == "seq"
        with pytest.raises(SpecError, match=f"torchtitan.{field}.*{words}"):
            Case.loads(json.dumps(spec))


def test_the_llama_draw_gives_valid_even_configs():
    from hypothesis import given, settings

    from harness.paths.torchtitan.data import LLAMA, knobs

    (step,) = LLAMA.steps

    @settings(max_examples=60, deadline=None, database=None)
    @given(step(nested(microbatches=2)))
    def drawn(case):
        k = knobs(case)
        assert Case.loads(case.dumps()) == case
        assert k.heads % 2 == k.kv_heads % 2 == k.head_dim % 2 == 0 and (k.seq % 2 == 0 or not k.sp)
        assert k.heads % k.kv_heads == 0 and k.ignored < k.seq

    drawn()


def test_the_tp_contract_refuses_what_the_trainer_owns():
    (tp,) = resolve(TP)
    case = _tp_case()
    assert tp.supports(case) is None
    assert "zeroes" in tp.supports(replace(case, schedule=replace(case.schedule, zero_grad="keep")))
    assert "optimizer" in tp.supports(replace(case, schedule=replace(case.schedule, optimizer="sgd")))
    # the loss is not a power-of-two mean: any number of microbatches
    assert tp.supports(replace(case, schedule=replace(case.schedule, microbatches=3))) is None


def test_a_tp_observation_leaves_the_core_case_unobserved_and_reports_each_grad_once():
    """The ranks hold the same full grads, so both report a differing grad: it
    is one violation; the core case's grads and outputs are not compared."""
    from types import SimpleNamespace

    from harness.compare.values import compare
    from harness.paths.torchtitan.tp.paths import observation
    from oracles.eager import observe

    case = _tp_case()
    v = {"k": 1, "what": "layers.0.ffn_norm.weight", "key": "grad layers.ffn_norm.weight", "detail": "off",
         "excess": 5000.0}
    reply = {"violations": [v], "failure": None, "steps": 2, "margin": 0.5}
    obs = observation(TP, case, SimpleNamespace(status="ok", seconds=1.0, detail="", replies={0: reply, 1: reply}))
    assert len(obs.steps) == 2 and obs.failure is None and obs.extra["margin"] == 0.5
    found = compare(case, observe(case), obs, retained_grads=False)
    assert [(d.kind, d.param, d.microbatch) for d in found] == [("grad", "layers.0.ffn_norm.weight", 1)]
    # the rank judged it against its own tolerance; a blunted harness (selfcheck --tolerance-slack) misses it
    from harness.compare.values import Tolerance

    assert compare(case, observe(case), obs, retained_grads=False, tol=Tolerance.for_case(case, slack=1e30)) == []
    failed = {"violations": [], "steps": 0, "failure": {"k": 0, "type": "ValueError", "message": "boom"}}
    obs = observation(TP, case, SimpleNamespace(status="ok", seconds=1.0, detail="", replies={0: failed, 1: reply}))
    assert obs.failure.type == "ValueError" and "rank 0: boom" in obs.failure.message


def test_the_tolerance_sits_far_below_a_missing_reduction():
    from harness.paths.torchtitan.tp.rank import _tolerance

    # a grad of scale 1 whose float32 eager error is 1e-7: a half (one rank's share) is ~1000x the tolerance
    assert 0.5 / _tolerance(1e-7, 1.0, 1.0) > 500


@needs_torchtitan
def test_on_cpu_changes_only_the_mesh_device_name(monkeypatch):
    """cpu.on_cpu sets the one name ParallelDims builds meshes with; in
    torchtitan's parallel_dims that name is read by init_device_mesh only,
    so no kernel, placement or collective choice on the TP path follows it."""
    import inspect
    import re

    import torchtitan.distributed.parallel_dims as pd

    from harness.paths.torchtitan import cpu

    monkeypatch.setattr(pd, "device_type", "cuda")
    assert cpu.on_cpu() and pd.device_type == "cpu" and not cpu.on_cpu()
    uses = [line.strip() for line in inspect.getsource(pd).splitlines() if re.search(r"\bdevice_type\b", line)]
    assert uses and all(u.startswith(("from torchtitan.tools.utils import device_type", "device_type,")) for u in uses), uses


@needs_torchtitan
def test_the_cpu_attention_is_causal_sdpa_on_both_sides_and_the_reference_keeps_its_rope():
    """cpu.attention's SDPA is built into the TP model and the float64
    reference alike, and is causal attention; the reference's complex RoPE
    cache survives its cast to float64 (``Module.to(float64)`` would cast it
    to real: the harness bug that made this path's first run diverge everywhere)."""
    from harness.paths.torchtitan import cpu
    from harness.paths.torchtitan.tp import rank as tp_rank

    cpu.without_triton()  # before torchtitan's model imports, which reach for triton
    from torchtitan.models.common.attention import ScaledDotProductAttention

    k = Knobs(heads=2, kv_heads=2, head_dim=4, seq=4)
    for config in (tp_rank.llama_config(k), tp_rank.sharded_config(k, 2)):
        assert all(isinstance(b.attention.inner_attention, ScaledDotProductAttention) for b in config.build().layers.values())
    q, kk, v = (torch.randn(1, 4, 2, 4, dtype=torch.float64) for _ in range(3))
    got = ScaledDotProductAttention(ScaledDotProductAttention.Config())(q, kk, v)
    s = torch.einsum("blnh,bmnh->bnlm", q, kk) / 2
    s = s.masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(got, torch.einsum("bnlm,bmnh->blnh", s.softmax(-1), v))
    case = _tp_case()
    full = tp_rank.weights(tp_rank.llama_config(k).build(), 0)
    data = tp_rank.batches(case, k)
    ref = tp_rank.llama_config(k).build()
    ref.init_states()
    ref = ref.double()
    assert ref.layers["0"].attention.rope.cache.is_complex()
    tp_rank.load(ref, full)
    x, y = data[0]
    loss = torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten(), reduction="sum")
    loss = loss / tp_rank.step_tokens(case, data, 0)
    loss.backward()
    want = tp_rank.eager(tp_rank.llama_config(k), full, torch.float64, case, data)[0]
    assert all(torch.equal(want[n], p.grad) for n, p in ref.named_parameters())


@needs_torchtitan
@pytest.mark.parametrize("knobs", [dict(tie=True, sp=True, ignored=1), dict(sp=False, loss_parallel=False, n_layers=2),
                                   dict(heads=4, kv_heads=2, head_dim=2, vocab=7, seq=6, batch=2, tie=True,
                                        loss_parallel=False, multiple_of=1),
                                   dict(vocab=5, seq=5, sp=False, ignored=2)],
                         ids=["tied-sp", "no-sp-no-loss-parallel", "gqa-uneven-vocab-and-ffn", "odd-sequence"])
def test_torchtitan_tp_agrees_with_float64_with_room_to_spare(knobs):
    from harness.engine.check import check

    (tp,) = resolve(TP)
    case = _tp_case(**knobs)
    assert check(case, tp) == []
    obs = tp.run(case)
    assert len(obs.steps) == 2 and obs.failure is None and not obs.violations
    assert obs.extra["margin"] < 0.1, obs.extra["margin"]  # the closest grad used under a tenth of its tolerance


@needs_torchtitan
def test_the_tp_norm_canary_is_caught_only_where_sequence_parallel_splits_the_tokens():
    from harness.canaries import all_canaries
    from harness.engine.check import check
    from harness.gate.selfcheck import run_canary

    (canary,) = [c for c in all_canaries() if c.name == "torchtitan_tp_norm_grad_not_all_reduced"]
    broken = canary.make()
    found = check(_tp_case(sp=True), broken)
    assert found and {d.param for d in found} <= {"layers.0.attention_norm.weight", "layers.0.ffn_norm.weight"}
    assert check(_tp_case(sp=False), broken) == []  # replicated tokens: each rank's share is the whole
    result = run_canary(canary, seed=0)
    assert result.caught and "norm.weight.grad" in result.detail, result.detail
