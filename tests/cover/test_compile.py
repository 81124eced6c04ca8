"""The compile paths: the structure cache, stats, errors as findings, the canary.

Compiles are slow, so these use ``aot_eager`` in-process on a handful of
small cases (one compile each, well under a second); the fuzzing runs are in
tests/nocover/test_compile_slow.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.paths.compile.canaries import canary_path
from harness.case.spec import Case, Hook, Input, Node, Param, Schedule, Use
from harness.engine.runner import Result, check, fuzz_path
from harness.paths.compile.cache import Stats, structure_key
from harness.paths.compile.flavors import FLAVORS
from harness.paths.compile.paths import CompilePath, Flavors, IsolatedCompilePath, FlavorWorker, other_size
from tests.helpers import nested


def _rich() -> Case:
    """Tied and transposed uses, a custom Function with a transposed grad, a
    scale hook, retain_grad, a view output, prefilled grads over two steps."""
    return Case(
        params=(Param("w0", (3, 3)), Param("b1", (3,))),
        inputs=(Input("x0", (2, 3), requires_grad=True),),
        nodes=(
            Node("n0", "matmul", (Use("x0"), Use("w0"))),
            Node("n1", "add", (Use("n0"), Use("b1"))),
            Node("n2", "layout_matmul", (Use("n1"), Use("w0", transpose=True)), (("layout", "transposed"),)),
        ),
        outputs=(Use("n2", transpose=True), Use("n1")),
        hooks=(Hook("n1", "scale", 2),),
        retain_grad=("n0",),
        schedule=Schedule(microbatches=2, steps=2, grad_init="prefilled", zero_grad="zeros"),
    )


def test_structure_key_ignores_data_and_schedule_but_not_the_graph():
    a = nested(microbatches=2)
    assert structure_key(a) == structure_key(dataclasses.replace(a, seed=7, exact=False, schedule=Schedule(3, 2)))
    assert structure_key(a) != structure_key(dataclasses.replace(a, hooks=(Hook("n0", "scale", 2),)))
    bigger = dataclasses.replace(a, inputs=(Input("x0", (5, 3), requires_grad=True),))
    assert structure_key(a) != structure_key(bigger)
    assert structure_key(a, shapes=False) == structure_key(bigger, shapes=False)


def _dropout_case(seed: int = 0) -> Case:
    """x @ w after dropout: the mask comes from the global RNG, seeded from the case's seed."""
    return Case(params=(Param("w0", (3, 3)),), inputs=(Input("x0", (4, 3), requires_grad=True),),
                nodes=(Node("n0", "dropout", (Use("x0"),)), Node("n1", "matmul", (Use("n0"), Use("w0")))),
                outputs=(Use("n1"),), seed=seed)


def test_a_random_case_is_compiled_per_seed_so_each_seed_draws_its_own_masks():
    """The compiled forward seeds the RNG from its structure's first case: a
    later seed that reused it ran the first seed's dropout masks (the 2.13
    cold-start findings compile.autograd-value-85eb26ea3a and others)."""
    assert structure_key(_dropout_case(0)) != structure_key(_dropout_case(1))
    path = CompilePath(FLAVORS["compile.aot_eager"])
    try:
        for seed in (0, 1, 2):
            assert check(_dropout_case(seed), path) == [], seed
    finally:
        path.close()


def test_inductor_flavours_compile_with_eager_random_numbers():
    """Inductor lowers torch.rand to a generator of its own (other numbers from
    the same seed) unless ``fallback_random`` is set; the dropout masks then
    differ from the oracle's and every dropout case is a false finding."""
    from torch._inductor import config as inductor_config

    for name, flavor in FLAVORS.items():
        with CompilePath(flavor).config():
            assert inductor_config.fallback_random == (flavor.backend == "inductor"), name
    assert not inductor_config.fallback_random
    assert "fallback_random = True" in CompilePath(FLAVORS["compile.inductor"]).repro(_dropout_case()).forward


def test_inductor_differentiates_the_masks_its_forward_drew_when_the_rng_is_seeded_before_the_call():
    """Seeded inside the compiled function, Inductor (fallback_random) took the
    forward's dropout mask right and differentiated another (grads off by
    0.2%, outputs equal; found by the cold compile run, seed 16): the
    harness's own seeding, so the compile paths seed before the call."""
    import json
    import os

    case = Case.from_json(json.load(open(os.path.join(os.path.dirname(__file__), "..", "data",
                                                      "compile_dropout_seeded_before_call.json"))))
    path = CompilePath(FLAVORS["compile.inductor"])
    try:
        assert check(case, path) == []
        assert not path.artifact(case)[0].built.seeds_itself
    finally:
        path.close()
    # and the standalone script compiles the forward unseeded, seeding before each call as the path does
    from harness.artifacts.repro import script

    text = script(case, "compile.inductor", path.repro(case))
    assert "def forward(v, seeded=True):" in text and "return forward(v, seeded=False)" in text
    import subprocess
    import sys
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    try:
        run = subprocess.run([sys.executable, f.name], capture_output=True, text=True, timeout=300)
    finally:
        os.unlink(f.name)
    assert run.returncode == 0 and "agrees" in run.stdout, run.stdout[-400:] + run.stderr[-400:]


def test_other_size_grows_the_batch_dim_only_where_the_shape_rules_allow():
    v = other_size(nested())
    assert v is not None and v.inputs[0].shape == (3, 3) and v.params == nested().params
    square = dataclasses.replace(nested(), inputs=(Input("x0", (3, 3)),),
                                 nodes=(Node("n0", "add", (Use("x0"), Use("w0"))),), outputs=(Use("n0"),))
    assert other_size(square) is None  # (4, 3) + (3, 3) does not broadcast


@pytest.mark.parametrize("flavor", ["compile.autograd"])
def test_compiled_grads_match_the_oracle_on_hooks_views_custom_functions_and_prefilled_grads(flavor):
    path = CompilePath(FLAVORS[flavor])
    try:
        for case in (_rich(), dataclasses.replace(_rich(), seed=3, exact=False)):
            assert check(case, path) == []
    finally:
        path.close()
    s = path.stats
    assert (s.cases, s.structures, s.hits) == (2, 1, 1), s  # the second seed reused the first compile
    assert s.graphs >= 1 and s.compile_s > 0 and s.not_compiled == 0 and s.limit_fallbacks == 0


def test_data_variations_reuse_one_artifact_and_eviction_drops_its_code():
    path = CompilePath(FLAVORS["compile.aot_eager"])
    path.cache.size = 1
    try:
        first = path.run(nested(2)).extra["compile"]
        again = path.run(dataclasses.replace(nested(2), seed=5)).extra["compile"]
        assert not first["hit"] and first["graphs"] >= 1
        assert again["hit"] and again["graphs"] == 0 and again["compile_s"] == 0.0 and again["run_s"] > 0
        other = path.run(_rich()).extra["compile"]
        assert not other["hit"] and other["evictions"] == 1
        back = path.run(nested(2)).extra["compile"]
        assert not back["hit"] and back["graphs"] >= 1  # evicted: compiled afresh, not served stale
    finally:
        path.close()
    assert path.cache.resets >= 1


def test_the_dynamic_paths_run_the_case_after_a_compile_at_another_size():
    path = CompilePath(FLAVORS["compile.dynamic.recompile"])
    path._backend_override = torch._dynamo.lookup_backend("aot_eager")  # the recompilation, without Inductor's cost
    try:
        obs = path.run(nested(2))
        assert obs.failure is None and obs.extra["compile"]["warm_size"] == (3, 3)
        assert obs.extra["compile"]["graphs"] >= 2  # one at the warm-up size, one after the guard failed
        assert check(dataclasses.replace(nested(2), seed=4), path) == []
    finally:
        path.close()


def _raising_backend(gm, example_inputs):
    raise RuntimeError("codegen failed for a valid graph")


def test_a_compiler_error_on_a_valid_case_is_an_error_finding():
    path = CompilePath(FLAVORS["compile.aot_eager"], backend=_raising_backend, name="compile.broken")
    try:
        (d,) = check(nested(2), path)
    finally:
        path.close()
    assert d.kind == "error" and "codegen failed" in d.detail


def _hanging_backend(gm, example_inputs):
    import time

    time.sleep(600)


class HangingFlavors(Flavors):
    """A recipe for the child: every flavour's compiler never returns."""

    def path(self, name: str) -> CompilePath:
        return CompilePath(FLAVORS[name], backend=_hanging_backend)


def test_a_hanging_compile_is_a_timeout_finding_and_the_worker_is_replaced():
    worker = FlavorWorker(timeout=3.0, recipe=("tests.cover.test_compile:HangingFlavors", {}))
    path = IsolatedCompilePath("compile.aot_eager", worker)
    try:
        (d,) = check(nested(), path)
        assert d.kind == "timeout" and "no result after 3s" in d.detail and d.path == "compile.aot_eager"
        assert worker._proc is None  # killed; the next case starts a fresh worker
    finally:
        path.close()


def test_the_scaled_grad_canary_is_caught_from_a_cold_start():
    canary, base = canary_path(), CompilePath(FLAVORS["compile.aot_eager"])
    result = Result()
    try:
        fuzz_path(canary, examples=30, deadline=None, seed=0, result=result, save_dir=None,
                  relative_to=base, detect_only=True)
    finally:
        canary.close()
        base.close()
    assert result.divergences, "the doubled grad survived 30 examples"
    d = result.divergences[0]
    assert d.kind == "value" and d.ratio == pytest.approx(2.0)


def test_stats_sum_per_case_figures():
    s = Stats()
    s.add({"hit": False, "graphs": 2, "compile_s": 1.5, "run_s": 0.1, "rss_mb": 300.0})
    s.add({"hit": True, "graphs": 0, "compile_s": 0.0, "run_s": 0.2, "rss_mb": 310.0})
    j = s.to_json()
    assert (j["cases"], j["structures"], j["hits"], j["graphs"], j["hit_rate"], j["rss_mb"]) == (2, 1, 1, 2, 0.5, 310.0)


def test_an_index_tensor_made_while_compiling_is_not_kept_for_later_cases():
    """Made inside a compiled region, the index tensor is a graph output: under
    mode="reduce-overhead" a CUDA-graph pool buffer the next run overwrites.
    The 2.11 gate on a GPU machine raised on the next embedding case's trace until the
    cache stopped keeping it; eager calls still build it once."""
    from harness.case import ops

    idx = (7, 3, 11)  # a key no other test builds
    key = ("cpu", idx)
    ops._IX.pop(key, None)
    f = torch.compile(lambda e: torch.nn.functional.embedding(ops._ix(e, idx), e), backend="eager", fullgraph=True)
    e = torch.randn(12, 2)
    assert torch.equal(f(e), e[list(idx)])
    assert key not in ops._IX
    first = ops._ix(e, idx)
    assert ops._IX[key] is first and ops._ix(e, idx) is first
    ops._IX.pop(key, None)


def test_an_outside_workaround_reaches_the_worker_so_known_is_causal_on_compile_paths():
    """The parent's context variable does not reach the compile worker; the
    workaround travels with the case. The triaged view steal seen through
    clip_grad_norm_ diverges on compile.aot_eager and is gone with clone-grads."""
    import os

    from harness.artifacts.corpus import load
    from harness.paths.workarounds import apply

    entry = load(os.path.join(os.path.dirname(__file__), "..", "..", "cases", "compile",
                              "clip_stack_alias_scaled_twice.json"))
    worker = FlavorWorker()
    try:
        p = IsolatedCompilePath("compile.aot_eager", worker)
        worked = apply(p, "clone-grads")
        assert worked is not None and worked.name == p.name and apply(p, "split-clone-adopted") is None
        assert check(entry.case, p) != []
        assert check(entry.case, worked) == []
        assert check(entry.case, p) != []  # in force for that case only
    finally:
        worker.close()


def test_every_flavour_gets_a_child_of_its_own():
    """One child shared by the flavours let their process-wide caches hide a
    compile-time error of one flavour; the factory must not share."""
    from harness.paths import Options
    from harness.paths.compile.paths import paths

    ps = paths(Options())
    try:
        assert len({id(p.worker) for p in ps}) == len(ps) == len(FLAVORS)
    finally:
        for p in ps:
            p.close()


def _grads(obs) -> dict:
    return {(s.k, n): g.clone() for s in obs.steps for n, g in s.grads.items() if g is not None}


def _same(x: dict, y: dict) -> bool:
    return x.keys() == y.keys() and len(x) > 0 and all(torch.equal(x[k], y[k]) for k in x)


def test_cases_submitted_ahead_give_what_one_at_a_time_gives():
    """``submit`` starts a case in each child before any result is read; the
    results must be those of running them in turn, read in any order, and a
    submitted case nobody reads must not be mistaken for the next one's."""
    from harness.engine.target import submit_ahead

    a, b = (IsolatedCompilePath(n, FlavorWorker(), overlaps=True) for n in ("compile.aot_eager", "compile.autograd"))
    one, two = nested(2), dataclasses.replace(nested(2), seed=7)
    try:
        alone = {p.name: _grads(p.run(one)) for p in (a, b)}
        alone_two = _grads(a.run(two))
        assert not _same(alone["compile.aot_eager"], alone_two)  # the two cases are told apart
        submit_ahead([a, b], one)
        assert a.worker.pending() and b.worker.pending()
        got = {p.name: _grads(p.run(one)) for p in (b, a)}  # read in the other order
        assert not a.worker.pending() and not b.worker.pending()
        assert all(_same(got[n], alone[n]) for n in alone)
        submit_ahead([a, b], one)
        assert _same(_grads(a.run(two)), alone_two)  # ``one`` was submitted, ``two`` asked for: drained, then run
        assert b.worker.pending()  # nobody read b's: it waits, harmless until b's next case
        assert _same(_grads(b.run(two)), _grads(b.run(two)))
    finally:
        a.close()
        b.close()


def test_a_submitted_case_that_hangs_times_out_from_when_it_was_sent():
    worker = FlavorWorker(timeout=3.0, recipe=("tests.cover.test_compile:HangingFlavors", {}))
    path = IsolatedCompilePath("compile.aot_eager", worker, overlaps=True)
    try:
        case = nested()
        path.submit(case)
        import time

        time.sleep(3.5)  # the whole timeout spent before anyone asks
        t0 = time.monotonic()
        obs = path.run(case)
        assert time.monotonic() - t0 < 2.0
        assert [v.kind for v in obs.violations] == ["timeout"] and worker._proc is None
    finally:
        path.close()


def test_flavour_children_overlap_by_the_cores_each_fuzz_worker_has(monkeypatch):
    from harness.workers import isolation

    monkeypatch.delenv(isolation.OVERLAP_ENV, raising=False)
    monkeypatch.setattr(isolation.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert isolation.overlap_procs(7) == 7  # one process on 16 cores: 8 spare, 7 flavours
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    assert isolation.overlap_procs(7) == 2
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "16")
    assert isolation.overlap_procs(7) == 1  # was 7 per worker: 112 children on 16 cores
    monkeypatch.setenv(isolation.OVERLAP_ENV, "3")
    assert isolation.overlap_procs(7) == 3
