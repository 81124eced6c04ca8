"""Generated repro scripts run whatever the case names its parts.

A repro script spells the case out as Python: its nodes become variables in
functions where the script binds names of its own (the ``PassThrough``
helper, a pipeline stage's arguments ``a0``, ``a1``, loop variables,
imports). A node named like one of them shadowed it: ``PassThrough =
PassThrough.apply(n0)`` raised UnboundLocalError, a stage node named ``a0``
overwrote the received activation. Names are drawn here from exactly the
names the scripts bind (collected from generated scripts with ``ast``) plus
the keywords and builtins the schema allows, and every script is run, as a
user runs it, on a case every path agrees on.
"""

from __future__ import annotations

import ast
import builtins
import keyword
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from harness.artifacts import repro
from harness.case import schema
from harness.case.spec import Case, SpecError
from harness.paths import close_paths, resolve

ROOT = Path(__file__).resolve().parents[2]
# One agreeing path per script template that runs on CPU: the template's
# name -> (path, launcher). "schedule" scripts run in this process (cheap);
# the ranked ones as a user runs them.
TEMPLATES = {"schedule": "eager.accumulate", "pipeline": "pipeline.GPipe.ranks2.fixed",
             "dataparallel": "ddp.stock", "torchrun": "dtensor.fixed"}
PLAIN = ("w0", "w1", "x0", "n0", "n1", "n2", "n3")


def _use(ref: str) -> dict:
    return {"ref": ref, "transpose": False, "index": None}


def named_case(w0: str, w1: str, x0: str, n0: str, n1: str, n2: str, n3: str) -> Case:
    """``(PassThrough(x0 @ w0) @ w1) * hook + x0 @ w0`` cut in two stages after
    ``n0``: the second stage reads its argument ``a0`` twice, before and after
    the nodes it assigns, and calls the ``PassThrough`` helper."""
    return Case.from_json({
        "version": 2, "dtype": "float32", "exact": True, "seed": 0,
        "params": [{"name": w0, "shape": [4, 4], "requires_grad": True, "placement": "colwise"},
                   {"name": w1, "shape": [4, 4], "requires_grad": True, "placement": "rowwise"}],
        "inputs": [{"name": x0, "shape": [2, 4], "requires_grad": True}],
        "nodes": [{"name": n0, "op": "matmul", "args": [_use(x0), _use(w0)], "attrs": []},
                  {"name": n1, "op": "passthrough", "args": [_use(n0)], "attrs": []},
                  {"name": n2, "op": "matmul", "args": [_use(n1), _use(w1)], "attrs": []},
                  {"name": n3, "op": "add", "args": [_use(n2), _use(n0)], "attrs": []}],
        "outputs": [_use(n3)], "hooks": [{"node": n2, "kind": "scale", "factor": 2}], "retain_grad": [n1],
        "schedule": {"microbatches": 2, "steps": 1, "grad_init": "none", "zero_grad": "set_to_none"},
        "family": {"pipeline": {"version": 1, "cuts": [1]}},
    })


@pytest.fixture(scope="module")
def paths():
    found = {t: p for t, p in zip(TEMPLATES, resolve(list(TEMPLATES.values())))}
    yield found
    close_paths(list(found.values()))


def _text(case: Case, path) -> str:
    machinery = path.repro(case)
    assert path.supports(case) is None and machinery.template in TEMPLATES, (path.name, machinery.template)
    return repro.script(case, path.name, machinery, title="names")


def _bound(text: str) -> set[str]:
    """Every identifier a script binds or reads: names, arguments, functions,
    classes and imports."""
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.alias):
            found.add(node.asname or node.name.split(".")[0])
    return found


def _allowed(name: str) -> bool:
    try:
        schema.name(name, "n")
    except SpecError:
        return False
    return True


def _collision_names() -> list[str]:
    """What a case could collide with: the scripts' own names (every template,
    with the helpers a case can pull in), keywords and builtins, as far as
    the schema takes them."""
    found = resolve(list(TEMPLATES.values()))
    try:
        texts = [_text(named_case(*PLAIN), p) for p in found]
    finally:
        close_paths(found)
    candidates = set().union(*map(_bound, texts)) | set(keyword.kwlist) | set(dir(builtins)) | {"a1", "a2", "p_n0"}
    return sorted(n for n in candidates if _allowed(n) and n not in PLAIN)


NAMES = _collision_names()
THAT_BROKE = ("w0", "w1", "x0", "n0", "PassThrough", "a0", "n3")  # UnboundLocalError; a0 overwritten in stage 1


def _run(text: str, template: str, where: Path) -> str:
    """Run the script as its reader would; the verdict line's words."""
    file = where / "repro.py"
    file.write_text(text)
    if template == "schedule":
        return "agrees" if runpy.run_path(str(file), run_name="gradfuzz_repro")["main"]() == 0 else "DIVERGES"
    launcher = ([] if template == "pipeline" else
                ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"])
    run = subprocess.run([sys.executable, *launcher, str(file)], capture_output=True, text=True, timeout=240, cwd=where,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    verdict = f"torch {torch.__version__}: agrees"
    assert verdict in run.stdout and run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return "agrees"


def test_the_collision_set_holds_what_the_scripts_bind():
    assert {"PassThrough", "a0", "leaves", "expected", "actual", "main", "params", "rank"} <= set(NAMES), sorted(NAMES)
    assert "p_n0" in NAMES and "torch" not in NAMES and "forward" not in NAMES  # refused by the schema itself


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_the_names_that_broke_scripts(paths, template, tmp_path):
    assert _run(_text(named_case(*THAT_BROKE), paths[template]), template, tmp_path) == "agrees"


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.lists(st.sampled_from(NAMES), min_size=7, max_size=7, unique=True))
def test_schedule_scripts_with_drawn_names(paths, tmp_path_factory, names):
    text = _text(named_case(*names), paths["schedule"])
    assert _run(text, "schedule", tmp_path_factory.mktemp("s")) == "agrees", names


@pytest.mark.parametrize("template", ["pipeline", "dataparallel", "torchrun"])
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(names=st.lists(st.sampled_from(NAMES), min_size=7, max_size=7, unique=True))
def test_ranked_scripts_with_drawn_names(paths, tmp_path_factory, template, names):
    text = _text(named_case(*names), paths[template])
    assert _run(text, template, tmp_path_factory.mktemp(template)) == "agrees", names
