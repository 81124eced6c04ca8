"""The graphed path on a CPU-only machine: stand-ins, contracts, isolation.

Real CUDA graphs need a GPU; here the graph wrappers run on the CPU replay
stand-in (tests/standins.py), which keeps what matters for the founding
bug: every replay writes into the same static buffers. The real paths are
checked for saying that they are unavailable, never passing.
"""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from harness.artifacts import corpus
from harness.artifacts import repro
from harness.paths import resolve
from harness.engine.runner import Result, check, fuzz_path
from harness.case.spec import Case, Event, Input, Node, Param, Schedule, SpecError, Use
from tests.standins import isolated, standin

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SEED_CASE = os.path.join(ROOT, "cases", "graphed", "make_graphed_callables_static_grad_alias.json")
NO_CUDA = not torch.cuda.is_available()


def aliased():
    return standin("standin.aliased", "tests.standins:aliased")


def fixed():
    return standin("standin.fixed", "tests.standins:fixed", owned_outputs=True)


def scale(microbatches=2, **schedule) -> Case:
    """The seed's module: x * w, one parameter, grads start as None."""
    return Case(params=(Param("w0", (4,)),), inputs=(Input("x0", (2, 4)),),
                nodes=(Node("n0", "mul", (Use("x0"), Use("w0"))),), outputs=(Use("n0"),),
                schedule=Schedule(microbatches=microbatches, **schedule), seed=2)


def gradfuzz(*args, timeout=300):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


# --- the real paths on a machine without CUDA ------------------------------------


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA: the graphed paths run (tests/nocover/test_graphed_gpu.py)")
def test_graphed_paths_say_they_are_unavailable_and_why():
    paths = resolve("graphed")
    assert [p.name for p in paths] == ["graphed.stock", "graphed.fixed", "graphed.compile"]
    for p in paths:
        a = p.availability()
        assert not a.ok and "needs CUDA" in a.reason
    r = gradfuzz("paths", "--paths", "graphed")
    assert r.returncode == 0 and r.stdout.count("UNAVAILABLE") == 3 and "needs CUDA" in r.stdout


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_cli_reports_graphed_as_not_run_never_as_passed(tmp_path):
    r = gradfuzz("replay", "cases/graphed", "--paths", "eager,graphed")
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(glob.glob(os.path.join(ROOT, "cases", "graphed", "*.json")))
    assert "eager.accumulate" in r.stdout and f"{n} run: {n} agree" in r.stdout, r.stdout
    for name in ("graphed.stock", "graphed.fixed", "graphed.compile"):
        assert f"{name}" in r.stdout and "NOT RUN" in r.stdout.split(name, 1)[1].splitlines()[0]
    f = gradfuzz("fuzz", "--paths", "graphed", "--examples", "3", "--json", str(tmp_path / "r.json"))
    assert f.returncode == 0, f.stdout + f.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["examples"] == 0 and set(data["unavailable"]) == {"graphed.stock", "graphed.fixed", "graphed.compile"}


# --- the stand-ins: the founding bug and its fix ---------------------------------


def test_seed_case_shows_g2_plus_g2_on_the_aliased_standin_and_not_on_fixed():
    entry = corpus.load(SEED_CASE)
    divs = check(entry.case, aliased())
    values = [d for d in divs if d.kind == "value"]
    assert values and "actual = 2*g2, expected g1 + g2" in values[0].detail
    assert "counted 2 times: a stale or overwritten buffer" in values[0].detail
    assert values[0].param == "w0" and values[0].microbatch == 1
    assert not check(entry.case, fixed())
    assert entry.expected_on("graphed.stock", torch.__version__)


def test_aliased_standin_is_caught_within_200_examples_and_shrinks_to_the_seed_shape(capsys):
    path = aliased()
    result = Result()
    fuzz_path(path, examples=200, deadline=None, seed=0, result=result, save_dir=None, exact=True)
    tally = result.paths[path.name]
    assert result.divergences and tally.first_hit_examples is not None and tally.first_hit_examples <= 200
    stale = [d for d in result.divergences if d.kind == "value" and "counted 2 times" in d.detail]
    assert stale, [d.detail for d in result.divergences]
    case = Case.from_json(stale[0].case)
    assert len(case.params) == 1 and case.schedule.backwards == 2 and case.schedule.grad_init == "none"
    with capsys.disabled():
        print(f"\nstandin.aliased: caught after {tally.first_hit_examples} examples ({tally.first_hit_seconds:.2f}s); "
              f"{len(result.divergences)} distinct divergences; shrunk: {stale[0].detail}")


def test_fixed_standin_stays_clean_on_lifetime_schedules():
    path = fixed()
    seen = {"events": 0, "hooks": 0, "outputs": 0}
    run = path.run

    def counting(case):
        s = case.schedule
        seen["events"] += bool(s.events)
        seen["hooks"] += bool(s.param_hooks)
        seen["outputs"] += s.retain_outputs
        return run(case)

    path.run = counting
    result = Result()
    fuzz_path(path, examples=120, deadline=None, seed=1, result=result, save_dir=None)
    assert not result.divergences, result.divergences[0].detail
    assert result.paths[path.name].run == 120
    assert all(n >= 10 for n in seen.values()), seen


def test_a_grad_kept_by_a_hook_must_not_change():
    case = scale(param_hooks=("hook_keep", "post_accumulate"))
    divs = check(case, aliased())
    kinds = {(d.kind, d.detail.split(" changed")[0]) for d in divs}
    assert ("mutation", "grad the w0 hook kept in backward 0") in kinds
    assert not check(case, fixed())
    assert not check(case, resolve("eager.accumulate")[0])


def test_hooks_see_what_eager_hooks_see():
    case = scale(param_hooks=("hook", "post_accumulate"))
    assert not check(case, resolve("eager.accumulate")[0])
    divs = check(case, aliased())
    # The post-accumulate hook sees the corrupted .grad; register_hook sees the true incoming grad.
    assert any(d.kind == "value" and "post_accumulate_grad_hook" in d.detail for d in divs)
    assert not any("w0 register_hook" in d.detail for d in divs)


def test_held_outputs_are_outside_the_stock_contract_and_kept_by_fixed():
    case = scale(retain_outputs=True)
    assert "static graph buffers" in aliased().supports(case)
    assert fixed().supports(case) is None
    assert not check(case, fixed())
    # Run anyway, the stock semantics overwrite the first output: why it is outside the contract.
    obs = aliased().run(case)
    assert any(m.what == "output 0 of backward 0" for m in obs.mutations)


def test_pressure_events_are_validated_and_round_trip():
    case = scale(microbatches=3, events=(Event(0, "alloc", (4, 2**16)), Event(1, "empty_cache"), Event(1, "free")),
                 param_hooks=("hook",))
    assert Case.loads(case.dumps()) == case
    assert not check(case, fixed()) and not check(case, resolve("eager.accumulate")[0])
    plain = scale()
    assert "events" not in plain.to_json()["schedule"] and "param_hooks" not in plain.to_json()["schedule"]
    data = case.to_json()
    data["schedule"]["events"][1]["after"] = 2
    with pytest.raises(SpecError, match=r"schedule\.events\[1\]\.after"):
        Case.from_json(data)
    data = case.to_json()
    data["schedule"]["param_hooks"] = ["sometimes"]
    with pytest.raises(SpecError, match=r"schedule\.param_hooks\[0\]: unknown 'sometimes'"):
        Case.from_json(data)


def test_the_repro_script_graphs_the_forward_and_shows_the_last_grad_twice(tmp_path):
    entry = corpus.load(SEED_CASE)
    script = tmp_path / "repro.py"
    script.write_text(repro.script(entry.case, "standin.aliased", aliased().repro(entry.case)))
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "counted 2 times" in r.stdout and "DIVERGES" in r.stdout
    fixed_script = tmp_path / "fixed.py"
    fixed_script.write_text(repro.script(entry.case, "standin.fixed", fixed().repro(entry.case)))
    r = subprocess.run([sys.executable, str(fixed_script)], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "agrees" in r.stdout, r.stdout + r.stderr


# --- crash isolation -----------------------------------------------------------


def test_a_segfault_is_a_crash_finding_with_its_case_and_the_session_goes_on():
    path = isolated("standin.crashes", "tests.standins:crashes")
    try:
        divs = check(scale(microbatches=2), path)
        assert [d.kind for d in divs] == ["crash"]
        assert "SIGSEGV" in divs[0].detail and divs[0].microbatch == 1
        assert not check(scale(microbatches=1), path), "a fresh worker runs the next case"
        assert path.restarts == 1
    finally:
        path.close()


def test_a_hang_is_a_timeout_finding():
    path = isolated("standin.hangs", "tests.standins:hangs", timeout=4)
    try:
        divs = check(scale(microbatches=2), path)
        assert [d.kind for d in divs] == ["timeout"] and "backward 1" in divs[0].detail
    finally:
        path.close()


def test_isolated_fixed_standin_agrees_and_returns_timings():
    path = isolated("standin.fixed", "tests.standins:fixed", owned_outputs=True)
    try:
        obs = path.run(scale())
        assert len(obs.steps) == 2 and obs.extra["build_s"] is not None and len(obs.extra["backwards_s"]) == 2
        assert not check(scale(), path)
    finally:
        path.close()


def test_children_started_soon_boot_side_by_side_and_run_as_if_started_on_use():
    """The gate starts the children its workaround checks will use all at once
    (``IsolatedPath.start_soon``): both are alive before either is used, each
    is started once, and what they observe is what a child started on use does."""
    soon = [isolated("standin.fixed", "tests.standins:fixed", owned_outputs=True) for _ in range(2)]
    late = isolated("standin.fixed", "tests.standins:fixed", owned_outputs=True)
    try:
        for p in soon:
            p.start_soon()
        assert all(p._proc is not None and p._proc.poll() is None for p in soon)
        crashing = isolated("standin.crashes", "tests.standins:crashes")
        crashing.start_soon()
        assert [d.kind for d in check(scale(microbatches=2), crashing)] == ["crash"]  # a crash after a soon start
        crashing.close()
        want = late.run(scale()).steps
        for p in soon:
            p.start_soon()  # already started: nothing happens
            got = p.run(scale()).steps
            assert p.starts == 1 and [s.grads.keys() for s in got] == [s.grads.keys() for s in want]
            assert all(torch.equal(g[k], w[k]) for s, t in zip(got, want) for g, w in [(s.grads, t.grads)] for k in w)
    finally:
        for p in (*soon, late):
            p.close()


def test_the_gate_s_clone_grads_reaches_a_graphed_child_and_undoes_an_adopted_static_grad():
    """A graph wrapper whose static grad buffer AccumulateGrad adopts as
    .grad (the next replay overwrites it: 2*g2) agrees once every parameter's
    grad arrives cloned: the workaround reaches the child with the case, as
    it reaches torch.compile's CUDA-graph trees there."""
    from harness.paths.workarounds import apply

    path = isolated("standin.aliased", "tests.standins:aliased")
    try:
        case = corpus.load(SEED_CASE).case
        assert "clone-grads" in path.workarounds
        assert check(case, path), "the aliased stand-in no longer adopts its static grad"
        assert check(case, apply(path, "clone-grads")) == []
        assert check(case, path), "the workaround stayed in force after its run"
    finally:
        path.close()
