"""Checkpoint paths, long runs: the fixed recomputation over many examples
and the RNG canary caught from a cold start by selfcheck on several seeds."""

import pytest

from harness.canaries import all_canaries
from harness.paths import resolve
from harness.engine.result import Result
from harness.engine.runner import fuzz_path
from harness.gate.selfcheck import run_canary

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("seed", range(5))
def test_rng_canary_is_caught_from_cold_start(seed, capsys):
    canary = next(c for c in all_canaries() if c.name == "checkpoint_forgets_rng")
    r = run_canary(canary, seed=seed)
    with capsys.disabled():
        print(f"\ncheckpoint_forgets_rng seed {seed}: caught={r.caught} after {r.examples} examples ({r.seconds:.1f}s)")
    assert r.caught, r.detail


@pytest.mark.parametrize("exact", [True, False])
def test_fixed_is_clean_over_500_examples(exact):
    result = Result()
    fuzz_path(resolve("checkpoint.fixed")[0], examples=500, deadline=None, seed=11, result=result,
              save_dir=None, exact=exact)
    assert result.divergences == [], result.divergences[0].detail
