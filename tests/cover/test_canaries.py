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


def _crashy():
    from harness.canaries import Canary

    return Canary("crashes_in_its_own_code",
                  lambda: SplitPath("canary.crashes_in_its_own_code", "tests.standins:crashes_in_its_own_code",
                                    stock_contract=True), "split.fixed", budget=100)


def test_a_canary_that_crashes_for_its_own_reasons_is_broken_not_caught():
    from harness.gate.selfcheck import run_canary

    r = run_canary(_crashy())
    assert r.state == "broken" and not r.caught
    assert "TypeError" in r.broken and "not the value" in r.broken


def test_a_broken_canary_fails_the_gate(monkeypatch, tmp_path):
    from harness.gate import run as gate
    from harness.gate import selfcheck

    monkeypatch.setattr(selfcheck, "all_canaries", lambda: [_crashy()])
    report = gate.run_gate(resolve("split.fixed"), corpus_dirs=[], ledger_file="cases/ledger.json", minutes=0,
                           save_dir=str(tmp_path))
    assert report.failed
    (row,) = [r for r in report.rows if r.status == "selfcheck"]
    assert "is broken" in row.detail and "TypeError" in row.detail
