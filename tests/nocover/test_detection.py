"""Detection statistics over many seeds (slow; run with ``pytest -m slow -s``).

Prints the median and worst examples and seconds to detection for each
canary, from a cold start (no database, no corpus), and the false-positive
count of the fixed implementation over 2000 examples in each mode.
"""

import statistics

import pytest

from harness.paths import resolve
from harness.paths.split.paths import SplitPath
from harness.engine.runner import Result, fuzz, fuzz_path
from harness.paths.split.canaries import CANARIES

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", sorted(CANARIES))
def test_detection_over_ten_seeds(name, capsys):
    impl, base = CANARIES[name]
    hits = []
    for seed in range(10):
        path = SplitPath(f"canary.{name}", impl, stock_contract=True)
        result = Result()
        fuzz_path(path, examples=300, deadline=None, seed=seed, result=result, save_dir=None,
                  relative_to=resolve(base)[0])
        t = result.paths[path.name]
        assert result.divergences, f"{name} survived 300 examples with seed {seed}"
        hits.append((t.first_hit_examples, t.first_hit_seconds))
    ex = [h[0] for h in hits]
    secs = [h[1] for h in hits]
    with capsys.disabled():
        print(f"\n{name}: examples to detection median {statistics.median(ex)} worst {max(ex)}; "
              f"seconds median {statistics.median(secs):.3f} worst {max(secs):.3f}")


@pytest.mark.parametrize("exact", [True, False])
def test_fixed_split_has_no_false_positives_over_2000(exact):
    result = fuzz(resolve("split.fixed"), examples=2000, seed=11, exact=exact, progress=lambda s: None)
    assert result.paths["split.fixed"].run == 2000
    assert not result.divergences, result.divergences[0].detail


def test_every_canary_is_missed_when_detection_is_blunted():
    """The whole self-check with every comparison loosened 1e30-fold: each
    canary runs its full budget and must be reported missed (the default run
    checks two cheap ones, tests/cover/test_gate.py)."""
    import os
    import subprocess
    import sys

    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    r = subprocess.run([sys.executable, "-m", "harness", "selfcheck", "--tolerance-slack", "1e30"], cwd=root,
                       env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "MISSED:" in r.stdout and "drops_accumulated" in r.stdout
    assert " caught after " not in r.stdout, r.stdout
