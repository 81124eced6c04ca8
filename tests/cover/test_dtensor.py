"""The DTensor paths on a real process group (gloo, 2 ranks, this machine's CPU).

Fast checks: the seed's case, the canary from a cold start, a short clean
fuzz of the fixed path, assembling values from shards, and the pool's fault
handling (hang, killed rank, Ctrl-C, killed parent) without orphans.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from packaging.version import Version

from harness.artifacts import corpus
from harness.observation import Observation
from harness.paths import resolve
from harness.paths.dtensor.canaries import canaries
from harness.paths.assemble import _assemble
from harness.paths.dtensor.paths import DTensorPath
from harness.engine.runner import Result, check, fuzz_path
from harness.case.spec import Case, Input, Node, Param, Schedule, Use

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = os.path.join(ROOT, "cases", "dtensor", "partial_grad_transposed_to_replicate.json")
HAS_FIX = Version(torch.__version__.split("+")[0]) >= Version("2.13")


def layout_case(layout: str, placement: str = "", microbatches: int = 1) -> Case:
    """x @ w through a custom backward that returns w's grad in ``layout``."""
    return Case(
        params=(Param("w0", (3, 3), placement=placement),),
        inputs=(Input("x0", (2, 3), requires_grad=True),),
        nodes=(Node("n0", "layout_matmul", (Use("x0"), Use("w0")), (("layout", layout),)),),
        outputs=(Use("n0"),),
        schedule=Schedule(microbatches=microbatches),
    )


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] != "Z":
                    out.append(pid)
        except FileNotFoundError:
            pass
    return out


def test_both_paths_are_listed_with_backend_and_world_size():
    for path in resolve("dtensor"):
        a = path.availability()
        assert a.ok, a.reason
        assert "gloo" in a.reason and "world size 2" in a.reason
    assert [p.name for p in resolve("dtensor")] == ["dtensor.stock", "dtensor.fixed"]


def test_seed_case_from_the_corpus():
    entry = corpus.load(SEED)
    stock, fixed = resolve("dtensor")
    assert not check(entry.case, fixed)
    stock_divs = check(entry.case, stock)
    assert bool(stock_divs) == (not HAS_FIX) == entry.expected_on("dtensor.stock", torch.__version__)


def test_canary_on_the_seed_case_names_param_placement_and_all_reduce():
    entry = corpus.load(SEED)
    (canary,) = canaries()
    divs = check(entry.case, canary.make())
    kinds = {d.kind: d for d in divs}
    assert set(kinds) == {"placement", "collective"}, [d.detail for d in divs]
    assert kinds["placement"].param == "w0" and "is Replicate" in kinds["placement"].detail
    assert "Partial(sum)" in kinds["placement"].detail and "non-contiguous" in kinds["placement"].detail
    assert "1 all_reduce" in kinds["collective"].detail and kinds["collective"].microbatch == 0


def test_canary_is_caught_from_cold_start(capsys):
    (canary,) = canaries()
    path = canary.make()
    result = Result()
    fuzz_path(path, examples=canary.budget, deadline=None, seed=0, result=result, save_dir=None,
              relative_to=resolve(canary.base)[0])
    tally = result.paths[path.name]
    assert result.divergences, f"the canary survived {canary.budget} examples"
    assert {d.kind for d in result.divergences} & {"placement", "collective"}
    with capsys.disabled():
        print(f"\n{canary.name}: caught after {tally.first_hit_examples} examples ({tally.first_hit_seconds:.2f}s): "
              f"{result.divergences[0].detail}")


def test_fixed_path_fuzzes_clean():
    """Clean but for DTensor's own op bugs, which the fixed grad layout
    cannot fix: the ledger lists those for dtensor.fixed too."""
    from harness.gate import ledger

    known = {s for b in ledger.load(os.path.join(ROOT, "cases", "ledger.json")).bugs
             if "dtensor.fixed" in b.path for s in b.signatures}
    (fixed,) = resolve("dtensor.fixed")
    result = Result()
    fuzz_path(fixed, examples=120, deadline=None, seed=3, result=result, save_dir=None)
    assert result.paths["dtensor.fixed"].run > 100
    new = [d for d in result.divergences if d.signature not in known]
    assert not new, new[0].detail


def test_a_one_rank_mesh_expects_no_collectives():
    """On a mesh of one rank DTensor redistributes locally; expecting the
    all-reduce of a 2-rank mesh was a harness false positive (--world-size 1,
    the only NCCL layout a single GPU allows)."""
    fixed = DTensorPath("dtensor.fixed", "oracles.dtensor_fixed", world_size=1)
    try:
        # x @ w @ w with a Shard(0) w and a zeroed .grad: the grad arrives
        # Shard(1) and is summed into Shard(0), an all-to-all on 2 ranks.
        case = Case(params=(Param("w0", (3, 3), placement="shard0"),), inputs=(Input("x0", (2, 3)),),
                    nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))), Node("n1", "matmul", (Use("n0"), Use("w0")))),
                    outputs=(Use("n1"),), schedule=Schedule(grad_init="zero"))
        assert not check(case, fixed)
        result = Result()
        fuzz_path(fixed, examples=60, deadline=None, seed=1, result=result, save_dir=None)
        assert result.paths["dtensor.fixed"].run > 40
        assert not result.divergences, result.divergences[0].detail
    finally:
        fixed.close()


@pytest.mark.parametrize("placement", ["replicate", "shard0", "shard1"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_dtensor_placed_parameters_agree_with_the_oracle(placement, layout):
    (fixed,) = resolve("dtensor.fixed")
    case = layout_case(layout, placement, microbatches=2)
    assert fixed.supports(case) is None
    obs = fixed.run(case)
    assert obs.failure is None and len(obs.steps) == 2
    assert not check(case, fixed)


def test_values_are_assembled_from_every_rank_and_replicas_must_agree():
    a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]])
    obs = Observation("t")
    enc = lambda pl, t: {"pl": pl, "local": t, "shape": (2, 2) if pl == "S0" else (1, 2), "stride": (2, 1)}
    assert torch.equal(_assemble(obs, set(), 0, "w", [enc("P", a), enc("P", b)], 2), a + b)
    assert torch.equal(_assemble(obs, set(), 0, "w", [enc("S0", a), enc("S0", b)], 2), torch.cat([a, b]))
    assert not obs.violations
    _assemble(obs, set(), 0, "w", [enc("R", a), enc("R", b)], 2)
    assert [v.kind for v in obs.violations] == ["replica"] and "rank 1" in obs.violations[0].detail


def test_hung_collective_is_a_timeout_and_the_pool_restarts():
    path = DTensorPath("dtensor.fault", "tests.canaries_dtensor:mismatched_collective", timeout=2.0)
    try:
        assert not check(layout_case("contiguous"), path)
        pids = path.group.pids
        t0 = time.monotonic()
        divs = check(layout_case("transposed"), path)
        assert time.monotonic() - t0 < 10
        assert [d.kind for d in divs] == ["timeout"]
        assert "did not finish within 2s" in divs[0].detail and "all_reduce" in divs[0].detail
        assert not alive(pids), "the hung pool was not torn down"
        assert not check(layout_case("contiguous"), path), "the next case runs normally"
        assert path.group.pids and set(path.group.pids).isdisjoint(pids)
    finally:
        path.close()


def test_killed_rank_is_a_crash_and_the_pool_restarts():
    path = DTensorPath("dtensor.fault", "tests.canaries_dtensor:kills_rank1", timeout=5.0)
    try:
        assert not check(layout_case("contiguous"), path)
        pids = path.group.pids
        divs = check(layout_case("transposed"), path)
        assert [d.kind for d in divs if d.kind != "error"] == ["crash"]
        crash = next(d for d in divs if d.kind == "crash")
        assert "rank 1" in crash.detail and "SIGKILL" in crash.detail
        assert not alive(pids)
        assert not check(layout_case("contiguous"), path)
    finally:
        path.close()
    assert not alive(pids + path.group.pids)


def _workers_of(pid: int, timeout: float = 60.0) -> list[int]:
    """The pool's workers: children of ``pid`` named by their process title or cmdline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().split(")")[-1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if ppid == pid:
                kids.append(int(entry))
        if len(kids) >= 2:
            return kids
        time.sleep(0.2)
    raise AssertionError("the pool never started")


@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_no_orphans_when_the_harness_is_interrupted_or_killed(how):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", "fuzz", "--paths", "dtensor.fixed", "--examples", "100000", "--save", ""],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        workers = _workers_of(proc.pid)
        time.sleep(1.0)  # mid-fuzzing
        if how == "ctrl-c":  # a terminal sends it to the whole foreground process group, workers included
            os.killpg(proc.pid, signal.SIGINT)
        else:  # the harness alone dies outright: no cleanup code of its own runs
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while alive(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(workers), f"orphaned workers {alive(workers)} after {how}"
        if how == "ctrl-c":
            assert proc.returncode == 130, proc.stderr.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("schedule", [
    dict(clip="2", optimizer="adam", optimizer_impl="foreach"),
    dict(clip="inf", optimizer="momentum", optimizer_impl="for_loop", steps=2, zero_grad="keep"),
    dict(clip="1", steps=2, zero_grad="keep"),
    dict(optimizer="adamw", optimizer_impl="fused", steps=2),
], ids=lambda s: "-".join(str(v) for v in s.values()))
@pytest.mark.parametrize("placement", ["", "replicate", "shard0"])
def test_training_steps_agree_on_the_fixed_path(schedule, placement):
    """clip_grad_norm_ and optimizer steps on DTensor parameters (Partial grads
    included), parameters and clipped grads compared after every step."""
    from dataclasses import replace

    (fixed,) = resolve("dtensor.fixed")
    case = layout_case("transposed", placement, microbatches=2)
    case = replace(case, dtype="float64", schedule=replace(case.schedule, **schedule))
    obs = fixed.run(case)
    assert obs.failure is None, obs.failure
    steps = [s for s in obs.steps if s.after_step]
    assert steps and all("w0.grad after optimizer.step()" in s.after_step or not case.schedule.optimizer for s in steps)
    assert not check(case, fixed)


@pytest.mark.parametrize("name", ["sgd_nesterov_foreach_writes_grad", "fused_adam_noncontiguous_shard_grad"])
def test_optimizer_bugs_in_the_corpus_show_on_stock_only(name):
    entry = corpus.load(os.path.join(ROOT, "cases", "dtensor", f"{name}.json"))
    stock, fixed = resolve("dtensor")
    divs = check(entry.case, stock)
    assert divs and all(d.kind == "value" and "after step" in d.detail for d in divs), [d.detail for d in divs]
    assert entry.expected_on("dtensor.stock", torch.__version__)
    assert not check(entry.case, fixed)


def _where_a_rank_died(out: str) -> str:
    """A native crash's stack (faulthandler's block, from rank 0 or 1) and the
    tail: torchrun's own report fills the tail and names no cause."""
    start = out.find("Fatal Python error")
    crash = out[start:start + 4000] + "\n...\n" if start >= 0 else ""
    return crash + out[-2500:]


def test_torchrun_rank0_drives_and_the_other_rank_follows(tmp_path):
    """Under torchrun the paths join the launcher's group: rank 0 fuzzes (here
    the canary, which must be caught), rank 1 runs what it is sent, both exit."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "-m", "harness", "fuzz", "--paths", "dtensor.stock",
         "--dtensor-impl", "harness.paths.dtensor.canaries:partial_to_replicate", "--examples", "300", "--seed", "0",
         "--save", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    out = r.stdout + r.stderr
    story = _where_a_rank_died(out)
    assert r.returncode != 0, story  # the canary's divergence: rank 0 exits 1, torchrun reports it
    assert "dtensor.stock placement" in out or "dtensor.stock collective" in out, story
    assert "is Replicate" in out or "all_reduce" in out, story
    assert list(tmp_path.glob("*.json")), "the shrunk case was saved"


@pytest.mark.parametrize("styles", [("colwise", "rowwise"), ("rowwise", "colwise"), ("colwise", "replicate")])
def test_tensor_parallel_styles_through_parallelize_module(styles):
    """Two weights used as h @ w run as nn.Linear under ColwiseParallel /
    RowwiseParallel; grads, accumulation and an optimizer step agree."""
    fixed = resolve("dtensor.fixed")[0]
    stock = resolve("dtensor.stock")[0]
    case = Case(
        params=(Param("w0", (3, 4), placement=styles[0]), Param("w1", (4, 3), placement=styles[1])),
        inputs=(Input("x0", (2, 3), requires_grad=True),),
        nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))), Node("n1", "relu", (Use("n0"),)),
               Node("n2", "matmul", (Use("n1"), Use("w1")))),
        outputs=(Use("n2"),),
        schedule=Schedule(microbatches=2, optimizer="adam", optimizer_impl="foreach"), dtype="float64",
    )
    for path in (stock, fixed):
        assert path.supports(case) is None
        assert not check(case, path)
    tied = Case(params=case.params, inputs=case.inputs, outputs=(Use("n3"),),
                nodes=case.nodes + (Node("n3", "matmul", (Use("n1"), Use("w0", transpose=True))),))
    assert "tensor-parallel" in fixed.supports(tied)  # a transposed use cannot go through nn.Linear


def test_forkserver_pool_as_used_with_nccl():
    """With CUDA the workers come from a forkserver (CUDA cannot be used in a
    forked child); the same start on CPU runs cases and leaves nothing behind."""
    from harness.workers import pool
    workers = pool.WorkerPool(2, "gloo", start_method="forkserver")
    pool.groups[(2, "forkserver-test")] = workers
    path = DTensorPath("dtensor.forkserver", "harness.paths.dtensor.canaries:partial_to_replicate", backend="forkserver-test")
    try:
        divs = check(corpus.load(SEED).case, path)
        assert {d.kind for d in divs} == {"placement", "collective"}
        pids = workers.pids
    finally:
        path.close()
        del pool.groups[(2, "forkserver-test")]
    assert pids and not alive(pids)


def test_placements_and_training_steps_are_case_data():
    """New fields round-trip through JSON, are left out at their defaults (old
    cases keep their JSON), and bad values are errors naming the field."""
    import json

    from harness.case.spec import SpecError

    case = layout_case("transposed", "shard1", microbatches=2)
    assert "placement" not in layout_case("transposed").dumps() and "optimizer" not in case.dumps()
    from dataclasses import replace

    trained = replace(case, schedule=replace(case.schedule, clip="inf", optimizer="adamw", optimizer_impl="fused", lr=0.01))
    assert Case.loads(trained.dumps()) == trained
    data = json.loads(trained.dumps())
    data["params"][0]["placement"] = "shard2"
    with pytest.raises(SpecError, match=r"params\[0\]\.placement"):
        Case.from_json(data)
    data = json.loads(trained.dumps())
    data["schedule"]["optimizer_impl"] = "fused"
    data["schedule"]["optimizer"] = "rmsprop"
    with pytest.raises(SpecError, match=r"schedule\.optimizer_impl.*no fused"):
        Case.from_json(data)


def test_pool_never_forks_on_a_machine_with_gpus(monkeypatch):
    """After autograd has run with GPUs present, a forked child cannot use
    autograd ("Unable to handle autograd's threading in combination with
    fork-based multiprocessing", seen on the GPU machine with gloo): only a machine
    without GPUs may fork its gloo workers."""
    import torch

    from harness.workers import pool

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pool.WorkerPool(2, "gloo")._context().get_start_method() == "forkserver"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pool.WorkerPool(2, "gloo")._context().get_start_method() == "fork"


def test_rprop_runs_only_where_dtensor_can_shard_index_put():
    """rprop's loop form needs index_put_; torch 2.11's DTensor has no
    strategy for it and raises on every path, so the case is outside the
    contract there, by asking DTensor rather than a version table."""
    from harness.paths.dtensor.paths import _has_strategy

    assert _has_strategy(torch.ops.aten.mm.default)
    assert not _has_strategy(torch.ops.aten._cdist_backward.default)
    case = Case(params=(Param("w0", (3, 3)),), inputs=(Input("x0", (2, 3), requires_grad=True),),
                nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))),), outputs=(Use("n0"),),
                schedule=Schedule(optimizer="rprop", optimizer_impl="for_loop"))
    why = DTensorPath("dtensor.fixed", "oracles.dtensor_fixed").supports(case)
    if _has_strategy(torch.ops.aten.index_put_.default):
        assert why is None
    else:
        assert "index_put_" in why


@pytest.mark.parametrize("impl, verdict", [("harness.paths.dtensor.canaries:partial_to_replicate", "DIVERGES"),
                                           ("oracles.dtensor_fixed", "agrees")])
def test_a_dtensor_finding_gets_a_torchrun_script_that_shows_it(tmp_path, impl, verdict):
    """The script a DTensor finding saves runs under torchrun with torch alone
    (plus the grad-layout handling under test) and says what gradfuzz saw."""
    from harness.artifacts import repro

    entry = corpus.load(SEED)
    path = DTensorPath("dtensor.under_test", impl)
    script = tmp_path / "repro.py"
    script.write_text(repro.script(entry.case, path.name, path.repro(entry.case), title="seed 002"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                       capture_output=True, text=True, timeout=180, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"})
    assert f"torch {torch.__version__}: {verdict}" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert (r.returncode != 0) == (verdict == "DIVERGES")


def test_a_grad_whose_local_shard_is_laid_out_unlike_its_parameter_is_a_layout_finding():
    path = DTensorPath("dtensor.fault", "tests.canaries_dtensor:transposes_replicate_grads", world_size=2)
    fixed = DTensorPath("dtensor.fixed", "oracles.dtensor_fixed", world_size=2)
    try:
        case = Case(params=(Param("w0", (3, 3), placement="replicate"),), inputs=(Input("x0", (2, 3)),),
                    nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))),), outputs=(Use("n0"),))
        found = {d.kind: d.detail for d in check(case, path)}
        assert "layout" in found and "local strides (1, 3)" in found["layout"], found
        assert not check(case, fixed)
    finally:
        path.close()
        fixed.close()


def test_a_script_places_an_opinfo_input_on_the_mesh_as_the_harness_did(tmp_path):
    """An OpInfo node whose input the case places Partial(sum): the script
    carries the placing helper too (it raised NameError without it), and
    shows the raise the harness saw, in mvlgamma's own backward."""
    from harness.artifacts import repro

    entry = corpus.load(os.path.join(os.path.dirname(SEED), "mvlgamma_partial_input_backward_raises.json"))
    path = DTensorPath("dtensor.fixed", "oracles.dtensor_fixed")
    script = tmp_path / "repro.py"
    script.write_text(repro.script(entry.case, path.name, path.repro(entry.case), title="mvlgamma on Partial"))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                       capture_output=True, text=True, timeout=180, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "NameError" not in r.stderr and "aten.digamma_.default: in-place operations" in r.stderr, \
        r.stdout[-2000:] + r.stderr[-2000:]
    assert r.returncode != 0
