"""The compile paths fuzzed for real (slow; ``pytest -m slow -s tests/nocover/test_compile_slow.py``).

Each compile path from a cold start for a bounded number of examples: every
divergence must be one the ledger knows for this torch (a new one fails and
is printed), no case may have run eagerly because a recompile limit was hit,
and the structure cache must have been used. The canary over five seeds.
The memory of a long session with a small cache must stay flat.
"""

from __future__ import annotations

import dataclasses
import os
import statistics

import pytest
from harness.paths.compile.canaries import canary_path
from harness.engine.runner import Result, fuzz_path
from harness.gate import ledger
from harness.paths import resolve
from harness.paths.compile.paths import FLAVORS, CompilePath

pytestmark = pytest.mark.slow
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CPU_FLAVORS = [n for n, f in FLAVORS.items() if f.device == "cpu"]


def _known_signatures() -> set[str]:
    return {s for b in ledger.load(os.path.join(ROOT, "cases", "ledger.json")).bugs for s in b.signatures}


@pytest.mark.parametrize("name", CPU_FLAVORS)
def test_compile_path_fuzzed_from_a_cold_start(name, capsys):
    (path,) = [p for p in resolve(name) if p.name == name]
    result = Result()
    try:
        fuzz_path(path, examples=60, deadline=None, seed=1, result=result, save_dir=None)
    finally:
        path.close()
    s = path.stats.to_json()
    with capsys.disabled():
        print(f"\n{name}: {result.paths[name].examples} examples; {s}")
        for d in result.divergences:
            print(f"  {d.signature} {d.kind}: {d.detail[:200]}")
    assert s["limit_fallbacks"] == 0 and s["hits"] > 0
    new = [d.signature for d in result.divergences if d.signature not in _known_signatures()]
    assert not new, f"{name}: divergences the ledger does not know: {new}"


def test_the_canary_is_caught_over_five_seeds(capsys):
    hits = []
    for seed in range(5):
        canary, base = canary_path(), CompilePath(FLAVORS["compile.aot_eager"])
        result = Result()
        try:
            fuzz_path(canary, examples=30, deadline=None, seed=seed, result=result, save_dir=None,
                      relative_to=base, detect_only=True)
        finally:
            canary.close()
            base.close()
        t = result.paths[canary.name]
        assert result.divergences, f"seed {seed}: the doubled grad survived 30 examples"
        hits.append((t.first_hit_examples, t.first_hit_seconds))
    with capsys.disabled():
        print(f"\ncompile_scaled_grad: examples {[h[0] for h in hits]}, seconds {[round(h[1], 2) for h in hits]}; "
              f"median {statistics.median(h[1] for h in hits):.2f}s")


def test_memory_stays_bounded_over_many_structures():
    """150 structures through a 4-entry cache with a full reset every 16: the
    resident memory after the last 50 is within 60 MB of after the first 50."""
    from tests.helpers import nested

    path = CompilePath(FLAVORS["compile.aot_eager"])
    path.cache.size, path.cache.reset_every = 4, 16
    rss = []
    try:
        for i in range(150):
            dim = 2 + i % 50
            case = dataclasses.replace(nested(), params=(dataclasses.replace(nested().params[0], shape=(dim, dim)),),
                                       inputs=(dataclasses.replace(nested().inputs[0], shape=(2 + i // 50, dim)),))
            obs = path.run(case)
            assert obs.failure is None, obs.failure
            rss.append(obs.extra["compile"]["rss_mb"])
    finally:
        path.close()
    assert path.stats.structures == 150 and path.stats.resets >= 9
    assert rss[-1] - rss[49] < 60, f"resident memory grew from {rss[49]} MB to {rss[-1]} MB"


def test_dropout_cases_agree_on_inductor_over_seeds_and_sizes():
    """Inductor's own generator draws other masks than eager's; with
    fallback_random (set by the path) every seed of a dropout case agrees,
    on the static and the dynamic path."""
    from harness.case.spec import Case, Input, Node, Param, Use
    from harness.engine.runner import check

    case = Case(params=(Param("w0", (3, 3)),), inputs=(Input("x0", (4, 3), requires_grad=True),),
                nodes=(Node("n0", "dropout", (Use("x0"),)), Node("n1", "matmul", (Use("n0"), Use("w0")))),
                outputs=(Use("n1"),))
    for name in ("compile.inductor", "compile.dynamic.symbolic"):
        path = CompilePath(FLAVORS[name])
        try:
            for seed in (0, 1):
                assert check(dataclasses.replace(case, seed=seed), path) == [], (name, seed)
        finally:
            path.close()
