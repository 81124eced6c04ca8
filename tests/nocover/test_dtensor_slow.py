"""Long DTensor runs: 500-example fuzzing of both paths, canary detection
statistics, world size 4, and pools under pytest-xdist (``pytest -m slow``)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import textwrap

import pytest

from harness.paths import Options, resolve
from harness.paths.dtensor.canaries import canaries
from harness.paths.dtensor.paths import DTensorPath
from harness.engine.runner import Result, check, fuzz_path
from harness.case.spec import Case

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=ROOT))


def test_fixed_path_500_examples_exit_0(tmp_path):
    r = _cli("fuzz", "--paths", "dtensor.fixed", "--examples", "500", "--seed", "1", "--save", str(tmp_path))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "dtensor.fixed" in r.stdout and "clean" in r.stdout


def test_stock_path_500_examples_finds_only_what_the_fixed_path_handles():
    """Whatever stock reports must be a bug of the machinery or of torch.optim,
    not of the harness: the fixed path runs every shrunk case clean, and
    eager.accumulate shows the non-DTensor ones too."""
    stock, fixed = resolve("dtensor")
    result = Result()
    fuzz_path(stock, examples=500, deadline=None, seed=1, result=result, save_dir=None)
    assert result.paths["dtensor.stock"].run > 400
    for d in result.divergences:
        case = Case.from_json(d.case)
        assert not check(case, fixed), f"fixed also diverges on stock's finding: {d.detail}"


def test_canary_detection_statistics(capsys):
    (canary,) = canaries()
    base = resolve(canary.base)[0]
    hits, secs = [], []
    for seed in range(5):
        path = canary.make()
        result = Result()
        fuzz_path(path, examples=canary.budget, deadline=None, seed=seed, result=result, save_dir=None,
                  relative_to=base)
        tally = result.paths[path.name]
        assert result.divergences, f"seed {seed}: canary survived {canary.budget} examples"
        hits.append(tally.first_hit_examples)
        secs.append(tally.first_hit_seconds)
    with capsys.disabled():
        print(f"\n{canary.name}: caught from cold start by every seed; examples {hits} "
              f"(median {statistics.median(hits)}), seconds {[round(s, 2) for s in secs]} "
              f"(median {statistics.median(secs):.2f})")


def test_world_size_4():
    stock, fixed = (p for p in resolve("dtensor", Options(world_size=4)))
    assert "world size 4" in fixed.availability().reason
    result = Result()
    fuzz_path(fixed, examples=80, deadline=None, seed=5, result=result, save_dir=None)
    fixed.close()
    assert not result.divergences, result.divergences[0].detail
    (canary,) = canaries()
    path = DTensorPath("canary.ws4", "harness.paths.dtensor.canaries:partial_to_replicate", world_size=4)
    result = Result()
    fuzz_path(path, examples=300, deadline=None, seed=0, result=result, save_dir=None)
    path.close()
    assert {d.kind for d in result.divergences} & {"placement", "collective"}


def test_pools_under_pytest_xdist_do_not_clash(tmp_path):
    """Two xdist workers, each with its own pool (a FileStore in its own temp
    dir, no ports), fuzzing at the same time."""
    test = tmp_path / "test_two_pools.py"
    test.write_text(textwrap.dedent("""
        import pytest
        from harness.paths import resolve
        from harness.engine.runner import Result, fuzz_path

        @pytest.mark.parametrize("seed", [11, 12, 13, 14])
        def test_fuzz(seed):
            (fixed,) = resolve("dtensor.fixed")
            result = Result()
            fuzz_path(fixed, examples=40, deadline=None, seed=seed, result=result, save_dir=None)
            assert not result.divergences
    """))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", str(test)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "4 passed" in r.stdout
