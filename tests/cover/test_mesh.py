"""The mesh paths on a 2 x 2 ("dp", "tp") mesh of 4 gloo ranks (this machine's CPU).

Fast checks: fixed cases agree with the oracle on all four paths, the
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
from harness.paths.mesh.path import MeshPath
from harness.workers import pool

NAMES = ["mesh.fsdp_tp.stock", "mesh.fsdp_tp.fixed", "mesh.dtensor2d.stock", "mesh.dtensor2d.fixed"]


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


def test_four_paths_on_a_four_rank_group(paths):
    assert list(paths) == NAMES
    for p in paths.values():
        a = p.availability()
        assert a.ok, a.reason
        assert "world size 4" in a.reason and "mesh (dp=2, tp=2)" in a.reason
    # The group is keyed by world size: not the 2-rank pool the other families share.
    mesh_group = paths["mesh.fsdp_tp.stock"].group
    assert mesh_group is pool.group(4) and mesh_group is not pool.group(2) and mesh_group.world_size == 4


@pytest.mark.parametrize("name", sorted(CASES))
def test_fixed_cases_agree_with_the_oracle_on_every_path(paths, name):
    case = CASES[name]
    for p in paths.values():
        assert p.supports(case) is None, (p.name, p.supports(case))
        obs = p.run(case)
        assert obs.failure is None and len(obs.steps) == case.schedule.backwards, (p.name, obs.failure)
        divs = check(case, p)
        assert not divs, (p.name, divs[0].detail)


def test_a_reference_that_skips_the_tp_reduce_is_caught(paths):
    (canary,) = canaries()
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
