"""Data-parallel paths (DDP, FSDP2) on a real gloo group started by the
harness: the case field, the fixed references, the stock wrappers on a
plain case, the contract, and both canaries against their bases."""

from dataclasses import replace

import os

import pytest
import torch

from harness.materialize.tensors import Built
from harness.materialize.names import attribute
from harness.materialize.units import CaseModule
from harness.paths.parallel.canaries import canaries
from harness.case.spec import Case, Input, Node, Param, Schedule, SpecError, Use
from harness.engine.check import check
from harness.paths import Options, resolve
from harness.paths.parallel.data import Switches
from harness.paths.parallel.paths import DataParallelPath


DATA = os.path.join(os.path.dirname(__file__), "..", "data")


def tied(parallel: tuple[str, ...] = ("no_sync", "small_buckets", "units"), **schedule) -> Case:
    """w0 tied across two units (and transposed), b1 with dim 0 smaller than
    the world size (an empty shard on rank 1), g2 used only in the second
    unit; two microbatches per window."""
    return Case(
        params=(Param("w0", (3, 3)), Param("b1", (1, 3)), Param("g2", (3,))),
        inputs=(Input("x0", (2, 3), requires_grad=True),),
        nodes=(
            Node("n0", "matmul", (Use("x0"), Use("w0"))),
            Node("n1", "add", (Use("n0"), Use("b1"))),
            Node("n2", "mul", (Use("n1"), Use("g2"))),
            Node("n3", "matmul", (Use("n2"), Use("w0", transpose=True))),
        ),
        outputs=(Use("n3"),),
        schedule=Schedule(microbatches=2, **schedule),
        seed=5,
    ).with_data("parallel", Switches(tuple(parallel), (2,) if "units" in parallel else ()) if parallel else None)


@pytest.fixture(scope="module")
def paths():
    made = {p.name: p for p in resolve(["ddp", "fsdp2"], Options(world_size=2))}
    yield made
    from harness.paths import close_paths

    close_paths(list(made.values()))


def test_parallel_switches_round_trip_and_unknown_ones_are_refused():
    case = tied()
    assert Case.loads(case.dumps()) == case
    assert "family" not in case.with_data("parallel", None).to_json()  # no switches: no data-parallel part
    bad = case.to_json()
    bad["family"]["parallel"]["options"] = ["no_sync", "sync_twice"]
    with pytest.raises(SpecError) as e:
        Case.from_json(bad)
    assert e.value.where == "case.family.parallel.options[1]" and "sync_twice" in str(e.value)


def test_units_put_a_weight_used_in_two_of_them_in_the_root():
    built = Built(tied())
    m = CaseModule(built, built.params(), "cpu", torch.float32, units=(2,))
    assert m.owner == {"w0": -1, "b1": 0, "g2": 1}
    assert [n for n, _ in m.blocks[1].named_parameters()] == [attribute("g2")]


@pytest.mark.parametrize("name", ["ddp.fixed", "fsdp2.fixed", "ddp.stock", "fsdp2.stock"])
@pytest.mark.parametrize("parallel", [(), ("no_sync", "small_buckets", "units"),
                                      ("bucket_view", "hook_allreduce", "keep_unsharded"),
                                      ("no_sync", "units", "checkpoint")])
def test_wrappers_agree_with_the_oracle_on_tied_uneven_accumulation(paths, name, parallel):
    path = paths[name]
    case = tied(parallel, grad_init="prefilled")
    assert path.supports(case) is None
    assert check(case, path) == []


def test_a_bf16_reduce_is_compared_at_bf16_and_still_catches_a_lost_microbatch(paths):
    """FSDP2 with reduce_dtype bfloat16 really rounds (its grads differ from
    the oracle's in float32's exactness), agrees within bf16's tolerance, and a
    grad off by a quarter (a microbatch of four lost) is still a finding."""
    from harness.compare.values import LOW_EPS, LOW_SLACK, Tolerance, compare
    from harness.engine.check import CaseCheck

    case = replace(tied(("no_sync", "units", "bf16_reduce")), exact=False)
    cc = CaseCheck(case)
    stock, ddp = paths["fsdp2.stock"], paths["ddp.stock"]
    assert stock.supports(case) is None and "needs NCCL" in ddp.supports(case)
    obs = cc.observe(stock)
    assert obs.precision == "bfloat16" and cc.observe(paths["fsdp2.fixed"]).precision is None
    rel = max(float(((obs.steps[-1].grads[n] - e).abs() / e.abs().clamp_min(1e-6)).max())
              for n, e in cc.oracle.steps[-1].grads.items() if e is not None)
    assert rel > 1e-5, "no bfloat16 rounding seen: the switch did not reach FSDP2"
    assert compare(case, cc.oracle, obs, tol=cc.tol) == []
    tol = Tolerance.for_case(tied()).lowered("bfloat16", tied())
    assert not tol.exact and tol.eps == LOW_EPS["bfloat16"] * LOW_SLACK and tol.precision == "bfloat16"
    last = obs.steps[-1]
    wrong = replace(obs, steps=[*obs.steps[:-1], replace(last, grads={n: g * 0.75 if g is not None else g
                                                                      for n, g in last.grads.items()})])
    found = compare(case, cc.oracle, wrong, tol=cc.tol)
    assert found and "rounds grads to bfloat16" in found[0].detail


def test_a_bf16_reduce_is_judged_by_what_it_rounded_not_by_term_sizes(paths):
    """The ranks' local grads of an rms_norm weight cancel in the average,
    while every term of the case is large: against term sizes a zeroed grad
    agreed. Against what FSDP2 really rounds (each rank's local grad, from
    the oracle run on that rank's share) it is a finding, and the stock
    wrapper's own rounding still agrees."""
    from harness.compare.values import compare
    from harness.engine.check import CaseCheck

    with open(os.path.join(DATA, "bf16_reduce_rms_norm_case.json")) as fh:
        case = Case.loads(fh.read())
    cc = CaseCheck(case)
    obs = cc.observe(paths["fsdp2.stock"])
    assert obs.precision == "bfloat16" and obs.rounded
    assert compare(case, cc.oracle, obs, tol=cc.tol) == []
    zeroed = replace(obs, steps=[replace(s, grads=s.grads and {n: None if g is None else g * 0
                                                                for n, g in s.grads.items()}) for s in obs.steps])
    from harness.compare.values import Tolerance

    by_terms = Tolerance.for_case(case)  # no account of the rounding, no eager noise: the hole term sizes leave
    assert compare(case, cc.oracle, replace(zeroed, rounded=None), tol=by_terms) == []
    found = compare(case, cc.oracle, zeroed, tol=cc.tol)
    assert found and "rounds grads to bfloat16" in found[0].detail


def test_exact_mode_needs_a_power_of_two_world():
    three = DataParallelPath("ddp.fixed", "ddp", "oracles.ddp_fixed", world_size=3)
    assert "power-of-two" in three.supports(tied())
    assert three.supports(replace(tied(), exact=False)) is None


def test_stock_ddp_contract_names_unused_parameters():
    case = replace(tied(), params=tied().params + (Param("u3", (3, 3)),))
    stock = DataParallelPath("ddp.stock", "ddp", "stock")
    assert "find_unused_parameters" in stock.supports(case)
    assert stock.supports(case.with_data("parallel", Switches(("find_unused",)))) is None


@pytest.mark.parametrize("canary", canaries(), ids=lambda c: c.name)
def test_canary_is_caught_where_its_base_agrees(paths, canary):
    case = tied(("small_buckets",))
    base = paths[canary.base]
    assert check(case, base) == []
    found = check(case, canary.make())  # the pool's group of two, shared with the bases
    assert found and {d.kind for d in found} <= set(canary.expects), [d.detail for d in found]
    if canary.name.startswith("ddp"):  # the double reduction is also seen as such, not only as a value
        assert any(d.kind == "collective" and "reduced 2 time(s)" in d.detail for d in found)


@pytest.mark.parametrize("kind, parallel, diverges", [
    ("ddp", ("small_buckets", "bucket_view"), False),
    ("fsdp2", ("no_sync", "keep_unsharded"), False),
    ("ddp", ("no_sync", "static_graph"), True),  # ledger ddp-static-graph-no-sync-first-backward
])
def test_standalone_script_runs_under_torchrun(tmp_path, kind, parallel, diverges):
    import os
    import subprocess
    import sys

    from harness.artifacts.repro import script

    case = tied(parallel).with_data("parallel", Switches(tuple(parallel)) if parallel else None)
    path = DataParallelPath(f"{kind}.stock", kind, "stock")
    repro = path.repro(case)
    assert repro.template == "dataparallel"
    file = tmp_path / "repro.py"
    file.write_text(script(case, path.name, repro))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(file)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = run.stdout + run.stderr
    if diverges:
        assert run.returncode != 0 and "INTERNAL ASSERT" in out, out[-2000:]
    else:
        assert run.returncode == 0 and "agrees" in run.stdout, out[-2000:]


def test_the_gates_workaround_reaches_the_ranks(paths):
    """The pool's message carries the workaround in force: DDP's and
    DTensor's ranks put clone-grads on their parameters (DTensor's copies a
    grad shard by shard, placements kept: no all-reduce of a Partial grad),
    so the view steal goes away with it; FSDP2 (sharded grads of its own)
    takes only optimizer-for-loop."""
    import os

    from harness.artifacts.corpus import load
    from harness.paths.workarounds import apply

    entry = load(os.path.join(os.path.dirname(__file__), "..", "..", "cases", "compile",
                              "clip_stack_alias_scaled_twice.json"))
    ddp = paths["ddp.stock"]
    worked = apply(ddp, "clone-grads")
    assert check(entry.case, ddp) != [] and check(entry.case, worked) == [] and check(entry.case, ddp) != []
    assert apply(paths["fsdp2.stock"], "clone-grads") is None and apply(paths["fsdp2.stock"], "optimizer-for-loop")
    (dt,) = resolve("dtensor.stock")
    steal = load(os.path.join(os.path.dirname(__file__), "..", "..", "cases", "eager", "accumulategrad_stack_alias.json"))
    assert check(steal.case, dt) != [] and check(steal.case, apply(dt, "clone-grads")) == []
    assert apply(dt, "optimizer-for-loop") is not None


def test_fused_adagrad_off_cpu_is_refused_only_where_torch_documents_it_cpu_only(monkeypatch):
    """One rule for every path whose parameters may live on CUDA (ranks on
    NCCL, compile.inductor.cuda, the graphed paths), read from the installed
    torch's own Adagrad documentation."""
    from harness.paths.engine_rules import fused_off_its_devices
    from tests.helpers import nested

    case = nested(microbatches=2)
    fused = replace(case, schedule=replace(case.schedule, optimizer="adagrad", optimizer_impl="fused"))
    monkeypatch.setattr(torch.optim.Adagrad, "__doc__", "fused (bool, optional): ... (CPU only) is used.")
    assert "CPU only" in fused_off_its_devices(fused, "cuda")
    assert fused_off_its_devices(fused, "cpu") is None
    assert fused_off_its_devices(case, "cuda") is None
    monkeypatch.setattr(torch.optim.Adagrad, "__doc__", "fused (bool, optional): ... (CPU and CUDA only) is used.")
    assert fused_off_its_devices(fused, "cuda") is None
