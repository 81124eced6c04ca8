"""The graphed paths on a real GPU (``pytest -m gpu``): real CUDA graphs.

Deselected by default; skipped, not passed, where torch sees no CUDA device.
benchmarks/graphed_gpu.py measures the same things at scale.
"""

import os

import pytest
import torch

from harness.artifacts import corpus
from harness.paths import resolve
from harness.engine.runner import Result, check, fuzz_path
from harness.case.spec import Case
from tests.standins import weakref_canary

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SEED_CASE = os.path.join(ROOT, "cases", "graphed", "make_graphed_callables_static_grad_alias.json")


@pytest.fixture(scope="module")
def graphed():
    paths = {p.name: p for p in resolve("graphed")}
    yield paths
    for p in paths.values():
        p.close()


def test_seed_case_on_real_cuda_graphs(graphed):
    entry = corpus.load(SEED_CASE)
    divs = check(entry.case, graphed["graphed.stock"])
    assert any(d.kind == "value" and "actual = 2*g2, expected g1 + g2" in d.detail for d in divs), divs
    assert not check(entry.case, graphed["graphed.fixed"])


def test_stock_caught_from_cold_start(graphed):
    result = Result()
    fuzz_path(graphed["graphed.stock"], examples=100, deadline=None, seed=0, result=result, save_dir=None, exact=True)
    assert any("counted 2 times" in d.detail for d in result.divergences), [d.detail for d in result.divergences]


def test_fixed_clean_with_pressure(graphed):
    result = Result()
    fuzz_path(graphed["graphed.fixed"], examples=200, deadline=None, seed=0, result=result, save_dir=None)
    assert not result.divergences, result.divergences[0].detail


def test_weakref_canary_caught_on_lifetime_schedules_while_fixed_stays_clean(graphed):
    """Seed 003's class: the canary holds its input surface by raw pointer. On
    the GPU machine it is caught within ten examples, with or without pressure
    events: the wrapper's own output clones and the loop's small allocations
    already take the freed blocks (benchmarks/graphed_gpu.py measures both)."""
    canary = weakref_canary()
    try:
        result = Result()
        fuzz_path(canary, examples=150, deadline=None, seed=0, result=result, save_dir=None)
        assert result.divergences, "the weak-ref surface canary survived 150 examples"
        for d in result.divergences:
            assert not check(Case.from_json(d.case), graphed["graphed.fixed"]), d.detail
    finally:
        canary.close()


def test_compile_runs_the_seed_case(graphed):
    path = graphed["graphed.compile"]
    if not path.availability().ok:
        pytest.skip(path.availability().reason)
    obs = path.run(corpus.load(SEED_CASE).case)
    assert obs.failure is None or obs.failure.message, obs
    assert len(obs.steps) == 2 or obs.failure is not None or obs.violations


@pytest.mark.parametrize("case_file", ["graphed/compile_grad_accumulation_silent_2x.json",
                                       "graphed/compile_grad_accumulation_overwritten_error.json"])
def test_cloned_grads_undo_cuda_graph_trees_adopting_an_output_as_grad(graphed, case_file):
    """torch.compile(mode='reduce-overhead') across microbatches: AccumulateGrad
    adopts a CUDA-graph-tree output as .grad and the next replay overwrites it
    (silently, or with the trees' overwritten-output error). A hook returning
    a clone of each incoming grad makes either case agree in a fresh child:
    the silent one's check in the ledger. The error one's case still raised
    with it in the gate's child after other cases, so there it is no check."""
    from harness.paths.workarounds import apply

    path = graphed["graphed.compile"]
    if not path.availability().ok:
        pytest.skip(path.availability().reason)
    case = corpus.load(os.path.join(ROOT, "cases", case_file)).case
    assert check(case, path), f"{case_file} agrees on graphed.compile without the workaround"
    assert check(case, apply(path, "clone-grads")) == []
