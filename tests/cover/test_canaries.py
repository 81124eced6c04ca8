"""Detection power: each deliberately wrong split implementation is caught
from a cold start (no database, no corpus) within 300 examples."""

import pytest
import torch
from packaging.version import Version

from harness.paths import resolve
from harness.paths.split.paths import SplitPath
from harness.materialize.source import forward_source
from harness.engine.runner import Result, fuzz_path
from harness.case.spec import Case
from harness.paths.split.canaries import CANARIES

STOCK_HAS_CLAMP = Version(torch.__version__.split("+")[0]) >= Version("2.13")


@pytest.mark.parametrize("name", sorted(CANARIES))
def test_canary_is_caught_from_cold_start(name, capsys):
    impl, base = CANARIES[name]
    if base == "split.stock" and not STOCK_HAS_CLAMP:
        pytest.skip("stock split before 2.13 has the double count itself: no clean base to inject into")
    path = SplitPath(f"canary.{name}", impl, stock_contract=True)
    result = Result()
    fuzz_path(path, examples=300, deadline=None, seed=0, result=result, save_dir=None,
              relative_to=resolve(base)[0])
    tally = result.paths[path.name]
    assert result.divergences, f"{name} survived 300 examples"
    d = result.divergences[0]
    assert d.kind == "value" and d.case is not None
    with capsys.disabled():
        print(f"\n{name}: caught after {tally.first_hit_examples} examples "
              f"({tally.first_hit_seconds:.2f}s); shrunk: {d.detail}\n{forward_source(Case.from_json(d.case))}")


def _crashy():
    from harness.paths.family import Canary

    return Canary("crashes_in_its_own_code",
                  lambda: SplitPath("canary.crashes_in_its_own_code", "tests.standins:crashes_in_its_own_code",
                                    stock_contract=True), "split.fixed", budget=100)


def test_a_canary_that_crashes_for_its_own_reasons_is_broken_not_caught():
    from harness.gate.selfcheck import run_canary

    r = run_canary(_crashy())
    assert r.state == "broken" and not r.caught
    assert "TypeError" in r.broken and "not the value" in r.broken


def test_a_broken_canary_fails_the_gate(monkeypatch, tmp_path):
    from harness.gate import phases
    from harness.gate import run as gate

    monkeypatch.setattr(phases, "for_paths", lambda names: [_crashy()])
    report = gate.run_gate(resolve("split.fixed"), corpus_dirs=[], ledger_file="cases/ledger.json", minutes=0,
                           save_dir=str(tmp_path))
    assert report.failed
    (row,) = [r for r in report.rows if r.status == "selfcheck"]
    assert "is broken" in row.detail and "TypeError" in row.detail


# --- the graphed canaries (seeds 000 and 003): real CUDA graphs only ---------------

GRAPHED = ("graphed_static_grad_views", "graphed_weak_input_surface")


def _graphed_canaries():
    from harness.canaries import all_canaries

    return {c.name: c for c in all_canaries() if c.name in GRAPHED}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the graphed canaries run (-m gpu)")
def test_graphed_canaries_are_listed_and_skipped_without_cuda_never_caught(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from harness.gate.selfcheck import selfcheck

    found = _graphed_canaries()
    assert sorted(found) == sorted(GRAPHED)
    assert all(c.base == "graphed.fixed" for c in found.values())
    results = selfcheck(canaries=[found[n] for n in GRAPHED])
    for r in results:
        assert r.state == "skipped" and not r.caught and not r.broken, r
        assert "needs CUDA" in r.skipped, r.skipped
    # The CLI, as the gate's -n runs each canary: skipped with the reason, counted apart from caught.
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    out = tmp_path / "selfcheck.json"
    r = subprocess.run([sys.executable, "-m", "harness", "selfcheck", "--canaries", ",".join(GRAPHED),
                        "--json", str(out)],
                       cwd=root, env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0/2 canaries caught, 2 skipped" in r.stdout, r.stdout
    for name in GRAPHED:
        line = next(line for line in r.stdout.splitlines() if line.strip().startswith(name))
        assert "skipped: unavailable here: needs CUDA" in line, line
    data = json.loads(out.read_text())
    assert [d["name"] for d in data] == list(GRAPHED)
    assert all(not d["caught"] and "needs CUDA" in d["skipped"] for d in data)


def test_a_canary_that_cannot_run_here_gets_no_process_in_the_gates_self_check(monkeypatch):
    """``gate -n N`` runs each canary in a process of its own; one whose path
    cannot run here (the graphed ones without CUDA) is skipped with the same
    reason the process would give, without starting it."""
    from harness.canaries import all_canaries
    from harness.gate import selfcheck as sc

    found = _graphed_canaries()
    cheap = next(c for c in all_canaries() if c.name == "double_count_nested")
    started = []

    def jobs(argvs, n, folder, on_end, *a, **k):
        started.extend(key for key, _ in argvs)
        for key, argv in argvs:  # the runnable one, in this process as its job would
            out = argv[argv.index("--json") + 1]
            with open(out, "w") as fh:
                fh.write(sc.to_json([sc.run_canary(cheap)]))
            on_end(type("E", (), {"key": key, "returncode": 0, "seconds": 0.0, "tail": lambda self: ""})())

    monkeypatch.setattr(sc, "run_jobs", jobs)
    results = sc.selfcheck(canaries=[found[GRAPHED[0]], cheap, found[GRAPHED[1]]], workers=2)
    assert started == [cheap.name]
    assert [r.name for r in results] == [GRAPHED[0], cheap.name, GRAPHED[1]]
    assert results[1].caught
    for r in (results[0], results[2]):
        assert r.state == "skipped" and r == sc.run_canary(found[r.name]), r


def views_on_cpu(module, sample_args, num_warmup_iters=3, allow_unused_input=False, pool=None):
    """The grad-views canary's own wrapper on the CPU replay stand-in (tests/standins.py)."""
    from harness.paths.graphed.canaries import static_grad_views
    from tests.standins import CpuReplay

    return static_grad_views(module, sample_args, num_warmup_iters, allow_unused_input, pool, backend=CpuReplay())


def test_graphed_grad_views_injection_is_seed_000_and_caught_within_its_budget_on_the_cpu_replay():
    """What the GPU canary injects, on the CPU replay (every replay writes the
    same static buffers): the seed case gives 2*g2, the fixed wrapper on the
    same backend agrees, and the canary's case stream (same contract, seed
    and budget as selfcheck's) catches it from a cold start."""
    from harness.artifacts import corpus
    from harness.engine.runner import check
    from harness.paths.graphed.paths import GraphedPath

    canary = _graphed_canaries()["graphed_static_grad_views"]
    views = GraphedPath("canary.views.cpu", "tests.cover.test_canaries:views_on_cpu", device="cpu", owned_outputs=True,
                        warmups=1)
    base = GraphedPath("standin.fixed", "tests.standins:fixed", device="cpu", owned_outputs=True, warmups=1)
    entry = corpus.load("cases/graphed/make_graphed_callables_static_grad_alias.json")
    divs = check(entry.case, views)
    assert any(d.kind == "value" and "actual = 2*g2, expected g1 + g2" in d.detail for d in divs), divs
    assert not check(entry.case, base)
    result = Result()
    fuzz_path(views, examples=canary.budget, deadline=None, seed=0, result=result, save_dir=None, relative_to=base,
              detect_only=True)
    firm = [d for d in result.divergences if not d.flaky]
    assert firm and all(d.kind in canary.expects for d in firm), [(d.kind, d.detail) for d in result.divergences]
    assert result.paths[views.name].first_hit_examples <= canary.budget


def test_graphed_weak_surface_canary_leaves_its_input_surface_to_the_allocator():
    """After capture nothing but raw pointers refers to the static input
    copies (the fixed wrapper keeps them): the autograd history of the
    captured outputs, which owns every input that requires grad through its
    AccumulateGrad node, is dropped too. Checked with storage weak
    references on a CPU backend that captures once and never replays (the
    freed memory is never touched)."""
    import contextlib

    from torch.multiprocessing.reductions import StorageWeakRef

    from harness.paths.graphed.canaries import WeakInputSurface
    from oracles import graphed_fixed

    class CaptureOnce(graphed_fixed.CudaGraphs):  # the CUDA backend's bookkeeping, no device
        def new_pool(self):
            return None

        def warmup_stream(self):
            return contextlib.nullcontext()

        def synchronize(self):
            pass

        def capture(self, fn, pool):
            return fn(), lambda: None

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3, 3))

        def forward(self, x, y):
            return (x @ self.w) * y

    def captured(kind):
        backend = CaptureOnce()
        m = kind(Module(), (torch.ones(2, 3, requires_grad=True), torch.ones(2, 3)), True, backend)
        refs = [StorageWeakRef(t.untyped_storage()) for t in m.static_inputs]
        ptrs = [t.data_ptr() for t in m.static_inputs]
        graphed_fixed.capture_all([m], 1, None, backend)
        return m, [r.expired() for r in refs], ptrs

    m, freed, ptrs = captured(WeakInputSurface)
    assert freed == [True, True]
    assert [t.data_ptr() for t in m.static_inputs] == ptrs  # the replays still write and read there
    assert [t.requires_grad for t in m.static_inputs] == [True, False]
    _, freed, _ = captured(graphed_fixed.GraphedCallable)
    assert freed == [False, False]  # the fixed reference holds its surface


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", GRAPHED)
def test_graphed_canary_is_caught_from_a_cold_start_on_cuda(name, capsys):
    from harness.gate.selfcheck import run_canary

    canary = _graphed_canaries()[name]
    r = run_canary(canary)
    assert r.state == "caught", (r.state, r.detail, r.broken, r.skipped)
    assert r.examples is not None and r.examples <= canary.budget
    with capsys.disabled():
        print(f"\n{name}: caught after {r.examples} examples ({r.seconds:.1f}s): {r.detail}")


def test_loses_tied_site_drops_the_same_site_whatever_the_memory_layout():
    """Stock holds a weight's intermediates in set order (memory addresses):
    the canary must keep the same one on every run, or its detection count
    (and a gate's selfcheck) changes from run to run."""
    from harness.engine.check import CaseCheck
    from tests.helpers import nested

    path = SplitPath("canary.loses_tied_site", "harness.paths.split.canaries:loses_tied_site", stock_contract=True)
    case = nested(microbatches=2)
    seen, ballast = set(), []
    for i in range(12):
        ballast.append([torch.empty(17 * (i + 1)) for _ in range(i)])  # shift where the next nodes are allocated
        seen.add(tuple((d.param, d.max_abs) for d in CaseCheck(case).run(path)))
    assert len(seen) == 1 and next(iter(seen)), seen
