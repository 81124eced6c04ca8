"""A session's findings get the gate's causal check: known by what, or new."""

import json
import os

import pytest
import torch

from harness.artifacts import corpus
from harness.engine.check import CaseCheck
from harness.gate.confirm import confirm
from harness.paths import resolve

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
V = torch.__version__.split("+")[0]
CASE = "split/scale_hook_applied_twice.json"


def _findings():
    (path,) = [p for p in resolve("split.stock") if p.name == "split.stock"]
    case = corpus.load(os.path.join(ROOT, "cases", CASE)).case
    divs = CaseCheck(case).run(path)
    for d in divs:
        d.case = case.to_json()
    assert divs
    return path, divs


def _ledger(tmp_path, probe: str) -> str:
    sig = _findings()[1][0].signature
    led = tmp_path / "ledger.json"
    led.write_text(json.dumps({"gradfuzz_ledger": 1, "signature_scheme": 2, "bugs": [
        {"id": "hook-twice", "path": "split.stock", "torch": f">={V}", "summary": "s", "signatures": [sig],
         "probe": probe}]}))
    return str(led)


def test_a_finding_its_bugs_probe_removes_is_called_known(tmp_path):
    path, divs = _findings()
    said: list[str] = []
    done, left = confirm(divs, [path], _ledger(tmp_path, "split-clamp-every-intermediate"), 60, said.append)
    (got,) = done.values()
    assert (got.status, got.bug, left) == ("known_probe", "hook-twice", 0)
    assert "split-clamp-every-intermediate" in got.label() and said and "[confirm] 1/1" in said[0]


def test_a_finding_its_bugs_probe_leaves_wrong_is_not_called_known(tmp_path):
    path, divs = _findings()
    done, _ = confirm(divs, [path], _ledger(tmp_path, "split-param-groups-apart"), 60)
    (got,) = done.values()
    assert got.status == "resembles" and got.label().startswith("NEW? resembles hook-twice")


@pytest.mark.parametrize("workaround, claimed", [("clone-grads", True), ("optimizer-for-loop", False)])
def test_a_finding_no_entry_records_is_claimed_where_its_paths_bug_claims_by_workaround(tmp_path, workaround,
                                                                                       claimed):
    """A bug whose error depends on the case's numbers (the pipeline stages'
    made-up inference inputs) claims by workaround in the gate; a session
    checks the same, and what its workaround leaves wrong stays unlisted."""
    (path,) = resolve("eager.accumulate")
    case = corpus.load(os.path.join(ROOT, "cases", "eager", "accumulategrad_stack_alias.json")).case
    divs = CaseCheck(case).run(path)
    for d in divs:
        d.case = case.to_json()
    led = tmp_path / "ledger.json"
    led.write_text(json.dumps({"gradfuzz_ledger": 1, "signature_scheme": 2, "bugs": [
        {"id": "steal", "path": "eager.accumulate", "torch": f">={V}", "summary": "s", "workaround": workaround,
         "claims": "workaround"}]}))
    done, left = confirm(divs, [path], str(led), 60)
    if claimed:
        assert {(c.status, c.bug) for c in done.values()} == {("known", "steal")} and left == 0
        assert all("claimed by steal" in c.note for c in done.values())
    else:
        assert done == {} and left == 0


def test_the_check_stops_at_its_time_budget_and_counts_what_it_left(tmp_path):
    path, divs = _findings()
    done, left = confirm(divs, [path], _ledger(tmp_path, "split-clamp-every-intermediate"), 0)
    assert done == {} and left == 1


def test_a_fuzzing_session_ends_with_the_check(tmp_path):
    """``gradfuzz fuzz`` says known or new for what it found, not only
    "resembles": split.stock's hook bug is confirmed by its fix probe."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "harness", "fuzz", "--paths", "split.stock", "--examples", "30",
                          "--seed", "1", "--db", "none", "--save", str(tmp_path / "found")],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "[confirm] 1/" in out.stderr
    tail = out.stdout[out.stdout.index("known or new"):]
    assert "split.stock [split.stock-value-b2774e4ce6]: known (fix probe) split-hook-applied-twice" in tail


def test_no_check_with_confirm_seconds_zero(capsys):
    import argparse

    from harness.cli.fuzz import confirm_findings

    path, divs = _findings()
    confirm_findings(type("R", (), {"divergences": divs})(), [path], argparse.Namespace(confirm_seconds=0.0))
    out = capsys.readouterr()
    assert "known or new" not in out.out and "[confirm]" not in out.err
