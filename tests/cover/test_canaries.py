"""Detection power: each deliberately wrong split implementation is caught
from a cold start (no database, no corpus) within 300 examples."""

import pytest
import torch
from packaging.version import Version

from harness.paths import resolve
from harness.paths.split import SplitPath
from harness.out.source import forward_source
from harness.engine.runner import Result, fuzz_path
from harness.case.spec import Case
from harness.canaries.split import CANARIES

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
