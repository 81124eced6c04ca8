"""The mesh paths on a 2 x 2 ("dp", "tp") mesh of 4 gloo ranks (this machine's CPU),
and pipeline x data parallel on a ("pp", "dp") mesh of the same 4 ranks.

Fast checks: fixed cases agree with the oracle on all four 2-D paths, the
broken reference (the tp all-reduce skipped) is caught, the refusal rules,
the case data, and the 4-rank group being its own pool and reported
unavailable (never passed) where it cannot start. Longer fuzzing is marked
slow.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness.case.spec import Case, Event, Input, Node, Param, Schedule, Use
from harness.case.vocab import SpecError
from harness.engine.check import check
from harness.engine.runner import Result, fuzz_path
from harness.paths import resolve
from harness.paths.mesh.canaries import canaries
from harness.paths.mesh.data import Placements
from harness.paths.mesh.paths import MeshPath
from harness.workers import pool

NAMES_2D = ["mesh.fsdp_tp.stock", "mesh.fsdp_tp.fixed", "mesh.dtensor2d.stock", "mesh.dtensor2d.fixed"]
NAMES = NAMES_2D + ["mesh.pp_dp.stock", "mesh.pp_dp.fixed"]


@pytest.fixture(scope="module")
def paths():
    made = {p.name: p for p in resolve("mesh")}
    yield made
    for p in made.values():
        p.close()


def mlp(codes: tuple[str, ...] | None = None, exact: bool = True, **schedule) -> Case:
    """x0 @ w0 -> relu -> @ w1, with a (4, 6) and a (6, 4) weight."""
    case = Case(params=(Param("w0", (4, 6)), Param("w1", (6, 4))),
                inputs=(Input("x0", (2, 4), requires_grad=True),),
                nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))), Node("n1", "relu", (Use("n0"),)),
                       Node("n2", "matmul", (Use("n1"), Use("w1")))),
                outputs=(Use("n2"),), schedule=Schedule(**schedule), exact=exact)
    return case.with_data("mesh", Placements(codes)) if codes else case


CASES = {
    "replicated": mlp(),
    "colwise_rowwise_2mb": mlp(("R,colwise", "S0,rowwise"), microbatches=2),
    "sharded_both_dims_prefill": mlp(("S0,S1", "S1,S0"), grad_init="prefilled", steps=2, microbatches=2),
    "tolerance_zero_grad": mlp(("R,rowwise", "S1,colwise"), exact=False, grad_init="zero"),
    "partial_dp_sharded": mlp(("S0,R", "R,S1")).with_data("mesh", Placements(("S0,R", "R,S1"), partial_dp=True)),
    "sgd_step": replace(mlp(("R,colwise", "R,rowwise"), steps=2, optimizer="momentum", optimizer_impl="foreach",
                            lr=0.1), dtype="float64"),
}


def test_six_paths_on_a_four_rank_group(paths):
    assert list(paths) == NAMES
    for p in paths.values():
        a = p.availability()
        assert a.ok, a.reason
        mesh = "mesh (pp=2, dp=2)" if ".pp_dp." in p.name else "mesh (dp=2, tp=2)"
        assert "world size 4" in a.reason and mesh in a.reason
    # The group is keyed by world size: not the 2-rank pool the other families share.
    mesh_group = paths["mesh.fsdp_tp.stock"].group
    assert mesh_group is pool.group(4) and mesh_group is not pool.group(2) and mesh_group.world_size == 4


@pytest.mark.parametrize("name", sorted(CASES))
def test_fixed_cases_agree_with_the_oracle_on_every_path(paths, name):
    case = CASES[name]
    for p in (paths[n] for n in NAMES_2D):
        assert p.supports(case) is None, (p.name, p.supports(case))
        obs = p.run(case)
        assert obs.failure is None and len(obs.steps) == case.schedule.backwards, (p.name, obs.failure)
        divs = check(case, p)
        assert not divs, (p.name, divs[0].detail)


def test_a_reference_that_skips_the_tp_reduce_is_caught(paths):
    (canary,) = [c for c in canaries() if c.name == "mesh_skips_tp_reduce"]
    broken = canary.make()
    try:
        divs = check(CASES["colwise_rowwise_2mb"], broken)
        assert {d.kind for d in divs} >= {"value", "replica"}, [d.detail for d in divs]
        assert not check(CASES["colwise_rowwise_2mb"], paths[canary.base])  # its base agrees
    finally:
        broken.close()


def test_refusals_say_why(paths):
    stock, d2 = paths["mesh.fsdp_tp.stock"], paths["mesh.dtensor2d.stock"]
    base = mlp()
    lifetime = replace(base, schedule=replace(base.schedule, microbatches=2, events=(Event(0, "empty_cache"),)))
    assert "buffer-lifetime" in stock.supports(lifetime)
    fused = replace(base, schedule=replace(base.schedule, optimizer="adam", optimizer_impl="fused"), dtype="float64")
    assert "fused" in stock.supports(fused) and "fused" in d2.supports(fused)
    rprop = replace(base, schedule=replace(base.schedule, optimizer="rprop", optimizer_impl="for_loop"))
    assert "rprop" in d2.supports(rprop)
    # A style on a weight used otherwise than as h @ w.
    tied = replace(base, nodes=base.nodes + (Node("n3", "matmul", (Use("n2"), Use("w0", transpose=True))),),
                   outputs=(Use("n3"),))
    tied = tied.with_data("mesh", Placements(("R,colwise", "R,R")))
    assert "right operand of a matmul" in stock.supports(tied)
    # Fewer elements than the ranks that shard the dim (2 x 2 on a dim of 2).
    thin = replace(base, params=(Param("w0", (2, 6)), Param("w1", (6, 4))), inputs=(Input("x0", (2, 2)),))
    thin = thin.with_data("mesh", Placements(("S0,S0", "R,R")))
    assert d2.supports(thin) is None  # one backward into an empty .grad: DTensor takes it
    assert "fewer elements than the ranks" in d2.supports(replace(thin, schedule=Schedule(microbatches=2)))
    assert stock.supports(thin) is None  # fsdp_tp reads only the styles; FSDP2 pads uneven dp shards
    # In place on a value that may be Partial: DTensor refuses to change its placement.
    inplace = replace(base, nodes=base.nodes + (Node("n3", "add_", (Use("n2"), Use("n2"))),), outputs=(Use("n3"),))
    assert d2.supports(inplace) is None  # Replicate parameters: nothing is Partial
    assert "in place with sharded parameters" in d2.supports(inplace.with_data("mesh", Placements(("R,R", "R,S1"))))
    # A chunk with an unused piece: its missing grad is a plain zeros tensor (raises on the fixed paths too).
    chunked = replace(base, nodes=base.nodes + (Node("n3", "chunk", (Use("n2"),), (("chunks", 2), ("dim", 1))),),
                      outputs=(Use("n3", index=0),))
    assert "multi-output chunk is unused" in stock.supports(chunked)
    assert d2.supports(replace(chunked, outputs=(Use("n3", index=0), Use("n3", index=1)))) is None


def _tied_transposed(codes: tuple[str, ...], summed: bool = True) -> Case:
    """x0 @ w0 and x0 @ w0.mT, summed (mesh.fixed-error-4d5d1aa689's case) or two outputs."""
    uses = (Node("n0", "matmul", (Use("x0"), Use("w0"))), Node("n1", "matmul", (Use("x0"), Use("w0", transpose=True))))
    nodes, outputs = (uses + (Node("n2", "add", (Use("n0"), Use("n1"))),), (Use("n2"),)) if summed else \
        (uses, (Use("n0"), Use("n1")))
    case = Case(params=(Param("w0", (3, 3)),), inputs=(Input("x0", (2, 3), requires_grad=True),), nodes=nodes,
                outputs=outputs)
    return case.with_data("mesh", Placements(codes))


@pytest.mark.parametrize("codes, summed, raises", [
    (("S0,S1",), True, True),  # (Partial, S1) + (S1, Partial): the add follows the first
    (("S1,S0",), True, True),
    (("S0,S1",), False, True),  # no forward add: x0's two grad contributions are summed
    (("S0,R",), True, False),  # (Partial, R) + (S1, R): the add follows the sharded one, Partial to Shard is fine
    (("S0,S0",), True, False),
    (("R,S1",), False, False),
])
def test_shard_to_partial_refused_only_before_2_13(monkeypatch, codes, summed, raises):
    """torch < 2.13's DTensor cannot redistribute Shard to Partial (2.11 raised it on mesh.dtensor2d.fixed and
    .stock, gloo and NCCL). The prediction is a dry run with the installed torch on a fake group: on 2.11.0
    (CPU wheel) it says so exactly for the cases here that raise on the real 4-rank gloo group; 2.13 plans no
    such redistribution, and the refusal is off there anyway."""
    import torch
    from packaging.version import Version

    from harness.paths.mesh import paths as mesh_path
    from harness.paths.mesh.redistribute import shard_to_partial

    old = Version(torch.__version__.split("+")[0]) < Version("2.13")
    case = _tied_transposed(codes, summed)
    for impl in ("stock", "oracles.dtensor_fixed"):
        found = shard_to_partial(case, impl)
        assert (found is not None) == (raises and old), found
    d2, fsdp = MeshPath("mesh.dtensor2d.fixed", "dtensor2d", "oracles.dtensor_fixed"), \
        MeshPath("mesh.fsdp_tp.fixed", "fsdp_tp", "oracles.mesh_fixed")
    assert mesh_path._NO_SHARD_TO_PARTIAL == old
    monkeypatch.setattr(mesh_path, "_NO_SHARD_TO_PARTIAL", True)
    reason = d2.supports(case)
    assert reason is None if not (raises and old) else "Shard into a Partial" in reason
    assert fsdp.supports(case) is None  # fsdp_tp reads only the styles
    monkeypatch.setattr(mesh_path, "_NO_SHARD_TO_PARTIAL", False)
    assert d2.supports(case) is None


def test_case_data_round_trips_and_is_checked():
    case = mlp(("S0,colwise", "S1,R"))
    again = Case.loads(case.dumps())
    assert again.data("mesh") == Placements(("S0,colwise", "S1,R"))
    partial = case.with_data("mesh", Placements(("R,R", "R,R"), partial_dp=True))
    assert Case.loads(partial.dumps()).data("mesh").partial_dp
    bad = mlp(("S2,R", "R,R"))
    with pytest.raises(SpecError, match="codes"):
        Case.loads(bad.dumps())


def test_wrong_world_under_torchrun_is_unavailable_without_joining(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    a = MeshPath("mesh.fsdp_tp.stock", "fsdp_tp", "stock").availability()
    assert not a.ok and "need 4 ranks" in a.reason


def test_a_group_that_cannot_start_makes_the_path_unavailable(monkeypatch):
    path = MeshPath("mesh.fsdp_tp.stock", "fsdp_tp", "stock", backend="gloo")

    def refuse(self):
        raise pool.PoolError("the gloo process group of 4 ranks did not start: (test)")

    key = pool.group_key(4, "gloo")
    monkeypatch.setitem(pool.groups, key, pool.WorkerPool(4, "gloo"))
    monkeypatch.setattr(pool.WorkerPool, "start", refuse)
    with pytest.raises(pool.PoolError):
        path.run(mlp())
    a = path.availability()
    assert not a.ok and "did not start" in a.reason


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mesh.fsdp_tp.fixed", "mesh.dtensor2d.fixed"])
def test_fixed_paths_fuzz_clean(name):
    """The references agree with the oracle on everything their contract takes
    (300 examples each at seed 0 on torch 2.13 CPU, docs/benchmarks.md session
    12). The stock paths are not held to this: they show ledger bugs."""
    (path,) = resolve(name)
    try:
        result = Result()
        fuzz_path(path, examples=150, deadline=None, seed=5, result=result, save_dir=None)
        assert result.paths[name].run > 50
        assert not result.divergences, result.divergences[0].detail
    finally:
        path.close()


# --- mesh.pp_dp: pipeline x data parallel on a ("pp", "dp") mesh ---------------------------------

from harness.registry import namespace  # noqa: E402
from oracles import mesh_pp_dp_fixed  # noqa: E402


def staged(cut: int = 2, schedule: str = "", wrapper: str = "", exact: bool = True, **sched) -> Case:
    """``mlp`` cut into two pipeline stages at node ``cut``, with a schedule and a dp wrapper."""
    case = mlp(exact=exact, **sched).with_data("pipeline", namespace("pipeline").cls((cut,)))
    data = Placements((), False, schedule, wrapper)
    return case.with_data("mesh", data if data != Placements() else None)


def tied(**kw) -> Case:
    """w0 used by both stages (each holds a copy; the grad is their sum)."""
    base = staged(**kw)
    return replace(base, nodes=base.nodes + (Node("n3", "matmul", (Use("n2"), Use("w0"))),), outputs=(Use("n3"),))


PP_CASES = {
    "gpipe_ddp_2mb_2steps_prefill": staged(microbatches=2, steps=2, grad_init="prefilled"),
    "1f1b_ddp_3mb_zero": staged(1, "1F1B", microbatches=3, grad_init="zero"),
    "gpipe_fsdp2_2mb_2steps": staged(schedule="", wrapper="fsdp2", microbatches=2, steps=2),
    "1f1b_fsdp2_4mb_tolerance": staged(2, "1F1B", "fsdp2", exact=False, microbatches=4),
    "tied_across_stages_ddp": tied(microbatches=2),
}


@pytest.mark.parametrize("name", sorted(PP_CASES))
def test_pp_dp_fixed_agrees_with_the_oracle_and_stock_runs(paths, name):
    case = PP_CASES[name]
    for n in ("mesh.pp_dp.fixed", "mesh.pp_dp.stock"):
        p = paths[n]
        assert p.supports(case) is None, (n, p.supports(case))
        obs = p.run(case)
        assert obs.failure is None and not obs.violations, (n, obs.failure, obs.violations)
        assert len(obs.steps) == case.schedule.backwards
        # grads after the last microbatch of every step, on every rank
        M = case.schedule.microbatches
        assert all((s.grads is not None) == (s.k % M == M - 1) for s in obs.steps)
    divs = check(case, paths["mesh.pp_dp.fixed"])
    assert not divs, divs[0].detail


def test_pp_dp_stock_agrees_where_torch_is_right(paths):
    """No prefilled .grad and no non-contiguous value across the cut: both wrappers, both schedules agree."""
    for schedule in ("", "1F1B"):
        for wrapper in ("", "fsdp2"):
            case = staged(2, schedule, wrapper, microbatches=2, steps=2)
            divs = check(case, paths["mesh.pp_dp.stock"])
            assert not divs, (schedule, wrapper, divs[0].detail)


def test_pp_dp_fixed_fuzzes_clean():
    """A short fuzz of the reference from a cold start: nothing it draws disagrees with the oracle."""
    (path,) = resolve("mesh.pp_dp.fixed")
    try:
        result = Result()
        fuzz_path(path, examples=30, deadline=None, seed=0, result=result, save_dir=None)
        assert result.paths["mesh.pp_dp.fixed"].run >= 20
        assert not result.divergences, result.divergences[0].detail
    finally:
        path.close()


def test_a_pp_dp_reference_that_skips_the_dp_reduce_is_caught(paths):
    """The test-only broken reference (each replica keeps its own grad) on a fixed case,
    and the family canary built from it caught from a cold start."""
    from harness.paths.mesh.paths import PpDpPath

    broken = PpDpPath("mesh.pp_dp.broken", "pp_dp", "tests.cover.test_mesh:SkipsDpReduce")
    try:
        divs = check(PP_CASES["gpipe_ddp_2mb_2steps_prefill"], broken)
        assert {d.kind for d in divs} >= {"value", "replica"}, [d.detail for d in divs]
    finally:
        broken.close()
    (canary,) = [c for c in canaries() if c.name == "mesh_pp_dp_skips_dp_reduce"]
    assert canary.base == "mesh.pp_dp.fixed"
    made = canary.make()
    try:
        result = Result()
        fuzz_path(made, examples=30, deadline=None, seed=0, result=result, save_dir=None,
                  relative_to=paths[canary.base])
        assert result.divergences, "the canary survived 30 examples"
        assert result.divergences[0].kind in canary.expects
    finally:
        made.close()


def test_pp_dp_refusals_say_why(paths):
    p = paths["mesh.pp_dp.stock"]
    assert "2 pipeline stages" in p.supports(mlp(microbatches=2))  # no cut: one stage
    three = mlp(microbatches=2).with_data("pipeline", namespace("pipeline").cls((1, 2)))
    assert "the case has 3" in p.supports(three)
    assert "Schedule1F1B refuses fewer microbatches" in p.supports(staged(schedule="1F1B"))
    frozen = staged(microbatches=2)
    frozen = replace(frozen, params=(frozen.params[0], replace(frozen.params[1], requires_grad=False)))
    assert "DistributedDataParallel" in p.supports(frozen)
    fsdp = frozen.with_data("mesh", Placements((), False, "", "fsdp2"))
    assert p.supports(fsdp) is None  # FSDP2 takes a stage with nothing to train
    step = staged(microbatches=2)
    step = replace(step, schedule=replace(step.schedule, optimizer="momentum", optimizer_impl="foreach", lr=0.1))
    assert "training step" in p.supports(step)


def test_pp_dp_case_data_round_trips_and_is_checked():
    case = staged(schedule="1F1B", wrapper="fsdp2", microbatches=2)
    again = Case.loads(case.dumps())
    assert again.data("mesh") == Placements((), False, "1F1B", "fsdp2")
    assert again.data("pipeline").cuts == (2,)
    bad = case.with_data("mesh", Placements((), False, "1F1B", "zero3"))
    with pytest.raises(SpecError, match="wrapper"):
        Case.loads(bad.dumps())


class SkipsDpReduce:
    """Test-only broken reference: ``oracles.mesh_pp_dp_fixed`` without the dp
    all-reduce (each replica keeps the grad of its own share)."""

    class Reference(mesh_pp_dp_fixed.Reference):
        def reduce_grads(self, step_grads, params):
            for n in sorted(step_grads):
                if step_grads[n] is not None:
                    p = params[n]
                    p.grad = step_grads[n].clone() if p.grad is None else p.grad + step_grads[n]


def test_clone_grads_reaches_a_ddp_stage_and_refuses_an_fsdp2_one(paths):
    """mesh.pp_dp takes the gate's clone-grads on a DDP stage (the view steal
    of interleaved_1f1b_two_ranks_stolen_views goes away); an FSDP2 stage's
    unsharded grads are out of any hook's reach, so such a case is outside
    the worked-around path, which says why."""
    import os

    from harness.artifacts import corpus
    from harness.paths.workarounds import apply

    root = os.path.join(os.path.dirname(__file__), "..", "..", "cases")
    p = paths["mesh.pp_dp.stock"]
    worked = apply(p, "clone-grads")
    steal = corpus.load(os.path.join(root, "pipeline", "interleaved_1f1b_two_ranks_stolen_views.json")).case
    assert check(steal, p) != [] and check(steal, worked) == []
    fsdp2 = corpus.load(os.path.join(root, "mesh", "pp_dp_fsdp2_prefilled_grad_dropped.json")).case
    assert "FSDP2" in (worked.supports(fsdp2) or "") and p.supports(fsdp2) is None
    assert apply(p, "optimizer-for-loop") is None
