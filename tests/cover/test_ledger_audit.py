"""The ledger against its own evidence (``gradfuzz ledger``): signatures its
cases show must be recorded under the entry whose case shows them, so that
``fuzz`` labels them and the gate cannot file a new bug under an old one."""

from __future__ import annotations

import json
import shutil

import torch

from harness.gate.audit import audit
from harness.paths import resolve

LEDGER = "cases/ledger.json"


def test_split_and_eager_entries_record_what_their_cases_show():
    found = audit(LEDGER, resolve("split,eager"), torch.__version__)
    assert found.checked, "no ledger entry ran on split or eager"
    bad = [p for p in found.problems if p.kind in ("misfiled", "unrecorded")]
    assert not bad, "\n".join(f"{p.kind} {p.bug} {p.signature}: {p.detail}" for p in bad)


def test_a_signature_filed_under_the_wrong_bug_is_reported(tmp_path):
    shutil.copy("cases/split/param_groups_share_graph.json", tmp_path / "case.json")
    right = audit(LEDGER, resolve("split.stock"), torch.__version__, only={"split-param-groups-share-graph"})
    assert not right.problems
    with open(LEDGER) as f:
        led = json.load(f)
    entry = next(b for b in led["bugs"] if b["id"] == "split-param-groups-share-graph")
    sig = next(p for p in entry["places"] if p["path"].startswith("split."))["signatures"][0]
    bugs = [
        {"id": "the-real-bug", "path": "split.stock", "torch": ">=2.0", "summary": "s", "cases": ["case.json"]},
        {"id": "another-bug", "path": "split.stock", "torch": ">=2.0", "summary": "s", "signatures": [sig]},
    ]
    (tmp_path / "ledger.json").write_text(json.dumps({"gradfuzz_ledger": 1, "signature_scheme": 2, "bugs": bugs}))
    found = audit(str(tmp_path / "ledger.json"), resolve("split.stock"), torch.__version__)
    assert [(p.kind, p.bug, p.signature) for p in found.problems] == [("misfiled", "the-real-bug", sig)]
    assert "another-bug" in found.problems[0].detail
    assert "another-bug on split.stock" in found.skipped  # no cases: named as skipped, not as consistent
