"""The replay's evidence and the gate's settings, without running a path."""

import pytest
import torch

from harness.gate import ledger
from harness.gate import run as gate
from harness.gate.evidence import Evidence
from harness.gate.rows import Row
from harness.observation import Divergence

V = torch.__version__.split("+")[0]


def _div(path: str, signature: str, shape: str) -> Divergence:
    return Divergence(path, "value", "w", 0, 1.0, 1.0, 2.0, "d", signature=signature, shape=shape)


def _ledger(tmp_path) -> ledger.Ledger:
    return ledger.Ledger([ledger.Bug.single("a", "p.one, p.two", f">={V}", "a", signatures=["sig-a"]),
                          ledger.Bug.single("b", "p.one", f">={V}", "b", signatures=["sig-b"]),
                          ledger.Bug.single("old", "p.one", "<1.0", "old", signatures=["sig-a"])], str(tmp_path))


def test_a_finding_is_owned_by_the_bug_whose_cases_showed_it_here(tmp_path):
    """By (path, signature) where the replay showed it; else by shape, on a
    path the bug's entry covers only."""
    ev = Evidence.of(_ledger(tmp_path), V, {"b": [_div("p.one", "sig-x", "shape-x")]})
    assert ev.owner(_div("p.one", "sig-x", "other")).id == "b"
    assert ev.owner(_div("p.one", "sig-y", "shape-x")).id == "b"
    assert ev.owner(_div("p.two", "sig-y", "shape-x")) is None  # b's entry does not cover p.two
    assert Evidence(ev.led, V).owner(_div("p.one", "sig-x", "shape-x")) is None


def test_a_row_fits_every_other_bug_in_range_that_its_signature_or_shape_names(tmp_path):
    led = _ledger(tmp_path)
    row = Row("known", "p.one", "d", "a", "sig-a", divergence={"shape": "shape-x"})
    assert Evidence(led, V).others(row) == []  # only a (the row's own) and old (out of range) record sig-a
    ev = Evidence.of(led, V, {"b": [_div("p.two", "sig-z", "shape-x")]})
    assert [b.id for b in ev.others(row)] == ["b"]  # b's cases showed the row's shape
    ev = Evidence.of(led, V, {"b": [_div("p.one", "sig-a", "")]})
    assert [b.id for b in ev.others(row)] == ["b"]  # b's cases showed the row's signature


def test_run_gate_takes_the_settings_fields_as_keywords():
    with pytest.raises(TypeError):
        gate.run_gate([], corpus_dirs=[], ledger_file="cases/ledger.json", minute=1)
    rep = gate.run(
        [], gate.GateSettings(corpus_dirs=[], ledger_file="cases/ledger.json", minutes=0, run_selfcheck=False))
    assert rep.rows == [] and list(rep.phases) == ["replay", "workarounds"]
