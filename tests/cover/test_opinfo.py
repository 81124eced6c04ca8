"""torch's OpInfo database as vocabulary: the shipped op table, the node, its
bound, its plain-data form, its standalone script and the fixed paths on it."""

import json
import os
import subprocess
import sys

import pytest
import torch

from harness.case import opinfo
from harness.case.opcall import opinfo_node
from harness.case.spec import Case, Schedule
from harness.case.vocab import SpecError
from harness.generate import interpret

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DRAWS = opinfo.draws()
# Every 7th drawable sample: a spread over the table that runs in seconds.
SOME = DRAWS[::7]

pytestmark = pytest.mark.skipif(not DRAWS, reason=f"no op table for torch {opinfo.version_key()} "
                                                  f"(python -m harness.case.optable_build writes it)")


def _case(*blocks, exact=False, microbatches=2) -> Case:
    return interpret(list(blocks), dim=3, batch=2, x_grad=True, exact=exact, out_kind=0,
                     schedule=Schedule(microbatches=microbatches), seed=1)


def _h(seed: int, dtype=torch.float64) -> torch.Tensor:
    return (torch.randn((2, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3).to(dtype)


def test_the_table_of_this_torch_is_wide_and_every_entry_resolves():
    keys = opinfo.keys()
    assert len(keys) >= 300, len(keys)
    bases = {k.split(":")[0] for k in keys}
    assert len(bases) >= 150, len(bases)
    for k in keys:
        assert callable(opinfo.callable_of(k)), k
    assert {k.split(":")[1] for k in keys if ":" in k} == {"method", "inplace"}


@pytest.mark.parametrize("key, i", SOME)
def test_each_sample_is_finite_deterministic_and_agrees_in_float32_within_a_sixteenth(key, i):
    from harness.case.optable_build import _float32_agrees

    call = opinfo.table()[key]["samples"][i]
    fn = opinfo.callable_of(key)
    a, b = opinfo_node(_h(0), fn, call), opinfo_node(_h(0), fn, call)
    assert torch.equal(a, b) and bool(a.isfinite().all())
    assert _float32_agrees(fn, call, _h(5)) == ""


@pytest.mark.parametrize("key, i", SOME)
def test_the_bound_dominates_value_and_grad_term_by_term(key, i):
    attrs = {"fn": key, "call": opinfo.table()[key]["samples"][i]}
    h = _h(3).requires_grad_()
    out = opinfo.run([h], attrs)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (g,) = torch.autograd.grad(out, h, dy)
    hb = h.detach().abs().requires_grad_()
    bound = opinfo.bound([hb], attrs)
    (gb,) = torch.autograd.grad(bound, hb, dy.abs())
    assert (out.detach().abs() <= bound.detach() + 1e-9).all()
    assert (g.abs() <= gb + 1e-9).all()


def test_a_case_with_opinfo_nodes_round_trips_and_is_tolerance_mode_only():
    case = _case(("linear", 0, 0), ("opinfo", 0, 0), ("opinfo", 0, len(DRAWS) - 1))
    assert [n.op for n in case.nodes].count("opinfo") == 2
    assert Case.loads(case.dumps()) == case
    assert "opinfo" not in {n.op for n in _case(("opinfo", 0, 0), exact=True).nodes}


def _with_call(mutate) -> dict:
    case = _case(("opinfo", 0, 0))
    data = json.loads(case.dumps())
    node = next(n for n in data["nodes"] if n["op"] == "opinfo")
    attrs = dict(node["attrs"])
    mutate(attrs)
    node["attrs"] = [[k, v] for k, v in attrs.items()]
    return data


@pytest.mark.parametrize("mutate, words", [
    (lambda a: a.update(fn="no_such_op"), "not in the op table"),
    (lambda a: a.update(fn="os.system('ls')"), "expected an op table key"),
    (lambda a: a["call"].__setitem__(0, "X"), "expected [\"C\""),
    (lambda a: a["call"].__setitem__(1, ["T", [10**6], 1, 0.0, 1.0]), "at most 6 dims and 1024"),
    (lambda a: a["call"].__setitem__(2, [["Z", 1]]), "tagged list"),
    (lambda a: a["call"].__setitem__(2, [float("nan")]), "finite number"),
    (lambda a: a["call"].__setitem__(2, ["os.system"]), "letters, digits or underscores"),
    (lambda a: a["call"].__setitem__(2, [["U", [["U", [["U", [["U", [["U", [1]]]]]]]]]]]), "nested 4 deep"),
    (lambda a: a["call"].__setitem__(3, [["__class__", 1]]), "lower-case identifier"),
    (lambda a: a["call"].__setitem__(4, [1.0, 2.0]), "[vmax, jrow, jcol, n_out]"),
    (lambda a: a["call"].__setitem__(2, [["I", "int64", [2], [1, 2, 3]]]), "expected 2 integers"),
])
def test_a_hostile_call_is_refused_naming_the_field(mutate, words):
    with pytest.raises(SpecError) as e:
        Case.from_json(_with_call(mutate))
    assert words in str(e.value) and "nodes[0]" in str(e.value), str(e.value)


def test_an_op_of_another_torch_s_table_loads_and_is_refused_before_it_runs(monkeypatch):
    """A corpus grown on a newer torch names ops an older one lacks: the case
    is valid data there, so replay and the gate count it as not run here
    (every path refuses it, naming the op) instead of exiting on the file."""
    from harness.engine.check import CaseCheck
    from harness.paths import resolve

    data = _with_call(lambda a: None)
    key = next(dict(n["attrs"])["fn"] for n in data["nodes"] if n["op"] == "opinfo")
    if not opinfo.elsewhere(key):
        pytest.skip(f"{key!r} is in this torch's table only")
    here = {k: v for k, v in opinfo.table().items() if k != key}
    monkeypatch.setattr(opinfo, "table", lambda: here)  # as if this torch's table lacked it
    case = Case.from_json(data)
    why = opinfo.unavailable(case.nodes)
    assert why and key in why and opinfo.elsewhere(key)[0] in why, why
    ran = list(CaseCheck(case).each(resolve("eager.accumulate,split.fixed")))
    assert [reason for _, reason, _ in ran] == [why, why] and not any(divs for _, _, divs in ran)


@pytest.mark.parametrize("path, hook, verdict", [("eager.accumulate", 1, "agrees"), ("split.stock", 2, "DIVERGES")])
def test_the_standalone_script_runs_the_node_with_torch_alone(tmp_path, path, hook, verdict):
    """A scale hook of 2 on ``x @ w`` before an OpInfo node: split.stock's
    founding bug (the hook runs twice) shows through the node; eager agrees."""
    from harness.artifacts.repro import script
    from harness.paths import resolve

    k = next(j for j, (key, _) in enumerate(DRAWS) if key == "sin")
    case = _case(("linear", 0, 0), ("hook", 0, 0 if hook == 2 else 2), ("opinfo", 0, k))
    (p,) = resolve(path)
    file = tmp_path / "repro.py"
    file.write_text(script(case, p.name, p.repro(case)))
    assert "from harness" not in file.read_text() and "opinfo_node(" in file.read_text()
    run = subprocess.run([sys.executable, str(file)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert f": {verdict} (" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


def test_fixed_paths_agree_on_drawn_opinfo_cases(tmp_path):
    report = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "harness", "fuzz", "--paths", "split.fixed,eager.accumulate",
                        "--examples", "80", "--seed", "3", "--mode", "tolerance", "--db", "none",
                        "--save", str(tmp_path / "found"), "--json", str(report)],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_the_screen_refuses_a_grad_that_changes_steeply_over_the_move():
    """polygamma(4, x) near its pole: a bound measured at a few points did not
    hold between them (a false finding on eager.accumulate)."""
    from harness.case.optable_build import screen

    steep = ("C", ("T", (6,), 3, 0.5, 0.8), (), (), (0.0, 0.0, 0.0, 0))
    why = screen(lambda x: torch.special.polygamma(4, x), opinfo.decode_call(steep, "steep"))
    assert isinstance(why, str) and "changes by more than" in why, why
    gentle = ("C", ("T", (6,), 3, 0.2, 0.4), (), (), (0.0, 0.0, 0.0, 0))
    assert not isinstance(screen(torch.sin, opinfo.decode_call(gentle, "gentle")), str)


def test_constants_are_not_cached_inside_a_torch_func_transform():
    """Inside a transform the forward builds its constants as user code would,
    whatever an earlier run in the process cached outside."""
    from harness.case.ops import _IX, _cached

    key = ("test-transform-cache",)
    made = []

    def make():
        made.append(1)
        return torch.tensor([1, 2])

    torch.func.grad(lambda x: (_cached(key, make), x.sum())[1])(torch.ones(2))
    assert key not in _IX and len(made) == 1
    _cached(key, make)
    torch.func.grad(lambda x: (_cached(key, make), x.sum())[1])(torch.ones(2))
    assert len(made) == 3  # outside: made and kept; inside: made again, the kept one not read
    _IX.pop(key, None)


def test_a_selective_recomputation_runs_the_ops_the_first_forward_ran():
    """The node makes its constants on every call: selective checkpointing
    replays its saved ops in order, and a constant cached by the first
    forward (in float32, after the float64 oracle cached its own) made the
    recomputation skip ops and raise 'Autograd not support dtype: Long'."""
    from harness.engine.check import check
    from harness.paths import resolve
    from harness.paths.checkpoint.data import Regions

    k = next(j for j, (key, _) in enumerate(DRAWS) if key == "abs:method")
    case = _case(("opinfo", 0, k), ("linear", 0, 0), microbatches=1).with_data("checkpoint", Regions((1,)))
    (path,) = resolve("checkpoint.selective.inverse.stock")
    assert path.supports(case) is None, path.supports(case)
    assert path.run(case).failure is None
    assert check(case, path) == []
