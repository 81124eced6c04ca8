"""The misuse class of findings: a stack that silently accepts a
use its docs do not support and gets it wrong. Such a finding carries
``finding_class: "misuse"`` in every record (checked as untrusted input like
every other field) and is listed apart in every report; the gate's verdict
treats it as any finding. The DeepSpeed drives that make them are tested in
``test_deepspeed.py``; these tests need no stack."""

import json
import xml.etree.ElementTree as ET

import pytest

from harness.artifacts import corpus, findings
from harness.cli import report as fuzz_report
from harness.engine.result import Result, Tally
from harness.gate import ledger
from harness.gate import report as gate_report
from harness.gate.run import GateReport, Row
from harness.observation import BUG_CLASS, MISUSE_CLASS, Divergence, finding_class_of
from harness.paths import resolve
from tests.helpers import nested


def _div(path: str, cls: str, sig: str) -> Divergence:
    return Divergence(path, "value", "w0", 1, 46.0, 11.5, 0.7081,
                      "w0 after backward 1: 9 of 9 elements differ; actual = 1*g2, expected g1 + g2", sig,
                      finding_class=cls)


MISUSE_SIG = "deepspeed.misuse-value-f46ded2aad"
BUG_SIG = "split.stock-value-b2774e4ce6"


def test_a_path_says_its_class_and_nothing_else_passes():
    class Misuse:
        name = "x.misuse"
        finding_class = MISUSE_CLASS

    class Odd:
        name = "x.odd"
        finding_class = "feature"

    (eager,) = resolve("eager.accumulate")
    assert finding_class_of(eager) == BUG_CLASS and finding_class_of(Misuse()) == MISUSE_CLASS
    with pytest.raises(ValueError, match="x.odd.*finding_class 'feature'"):
        finding_class_of(Odd())


def test_the_class_round_trips_through_a_finding_file_and_a_merge(tmp_path):
    (eager,) = resolve("eager.accumulate")
    case = nested(microbatches=2)
    for cls, sig in ((MISUSE_CLASS, MISUSE_SIG), (BUG_CLASS, BUG_SIG)):
        entry, script = findings.finding_entry(eager, case, [_div(eager.name, cls, sig)], "test")
        rec = findings.record(tmp_path / "found", sig, entry, script)
        back = corpus.load(rec.file)
        assert back.meta["finding_class"] == cls and back.meta["divergences"][0]["finding_class"] == cls
        assert Divergence.from_json(back.meta["divergences"][0]).finding_class == cls
    findings.merge([str(tmp_path / "found")], str(tmp_path / "merged"))
    assert corpus.load(tmp_path / "merged" / f"{MISUSE_SIG}.json").meta["finding_class"] == MISUSE_CLASS


def _finding_file(tmp_path, meta_class, div_class=MISUSE_CLASS):
    (eager,) = resolve("eager.accumulate")
    entry, _ = findings.finding_entry(eager, nested(), [_div(eager.name, MISUSE_CLASS, MISUSE_SIG)], "test")
    data = entry.to_json()
    data["meta"]["finding_class"] = meta_class
    data["meta"]["divergences"][0]["finding_class"] = div_class
    f = tmp_path / "hostile.json"
    f.write_text(json.dumps(data))
    return f


@pytest.mark.parametrize("meta_class, div_class, field", [
    ("feature", MISUSE_CLASS, "meta.finding_class"),
    (["misuse"], MISUSE_CLASS, "meta.finding_class"),
    ("misuse\nimport os", MISUSE_CLASS, "meta.finding_class"),
    (MISUSE_CLASS, 7, "meta.divergences[0].finding_class"),
    (MISUSE_CLASS, "", "meta.divergences[0].finding_class"),
])
def test_a_hostile_class_is_refused_with_exit_2_naming_the_file_and_field(tmp_path, capsys, meta_class, div_class,
                                                                           field):
    from harness.cli import main as cli

    f = _finding_file(tmp_path, meta_class, div_class)
    assert cli.main(["replay", str(f)]) == 2
    err = capsys.readouterr().err
    assert "hostile.json" in err and f"field {field}" in err, err


def test_a_hostile_class_in_a_ledger_or_a_gate_report_is_named():
    base = {"gradfuzz_ledger": 1, "signature_scheme": 2, "bugs": [
        {"id": "b", "path": "deepspeed.zero0.misuse", "torch": "", "summary": "s", "finding_class": "misuse"}]}
    assert ledger.from_json(base, "l.json").bugs[0].finding_class == MISUSE_CLASS
    assert "finding_class" in ledger.to_json(ledger.from_json(base, "l.json"))["bugs"][0]  # written back
    plain = {**base, "bugs": [{k: v for k, v in base["bugs"][0].items() if k != "finding_class"}]}
    assert "finding_class" not in ledger.to_json(ledger.from_json(plain, "l.json"))["bugs"][0]  # the default stays out
    base["bugs"][0]["finding_class"] = "wontfix"
    with pytest.raises(corpus.CorpusError, match=r"l\.json.*field bugs\[0\]\.finding_class"):
        ledger.from_json(base, "l.json")
    rep = GateReport("2.13.0", [Row("new", "deepspeed.zero0.misuse", "d", None, MISUSE_SIG,
                                    finding_class=MISUSE_CLASS)]).to_json()
    assert ledger.report_from_json(json.loads(json.dumps(rep)), "r.json")["rows"][0]["finding_class"] == MISUSE_CLASS
    rep["rows"][0]["finding_class"] = {"x": 1}
    with pytest.raises(corpus.CorpusError, match=r"r\.json.*field rows\[0\]\.finding_class"):
        ledger.report_from_json(rep, "r.json")


def _gate(misuse_status: str = "new") -> dict:
    d_bug, d_mis = _div("split.stock", BUG_CLASS, BUG_SIG), _div("deepspeed.zero0.misuse", MISUSE_CLASS, MISUSE_SIG)
    rows = [Row("known", "split.stock", d_bug.detail, "split-hook-applied-twice", BUG_SIG, "fuzz", None,
                d_bug.to_json()),
            Row(misuse_status, "deepspeed.zero0.misuse", d_mis.detail, None, MISUSE_SIG, "fuzz", {"case": 1},
                d_mis.to_json(), finding_class=MISUSE_CLASS)]
    return GateReport("2.13.0", rows, examples={"split.stock": 10}, seconds=3.0).to_json()


def test_the_gate_fails_on_a_new_misuse_lists_it_apart_in_every_form_and_passes_a_known_one():
    rep = _gate("new")
    assert rep["passed"] is False  # a new misuse fails the gate like any new finding
    head = gate_report.headline(rep)
    assert "1 new fail the gate; 1 known; of these, misuse: 1 new" in head, head
    term = gate_report.terminal(rep, width=200)
    lines = term.splitlines()
    at = lines.index(next(ln for ln in lines if ln.startswith("misuse findings")))
    assert lines[at + 1].startswith("MISUSE, NEW divergence: [deepspeed.misuse-value-f46ded2aad]")
    assert not any("MISUSE" in ln for ln in lines[:at]) or "misuse: 1 new" in lines[0]
    assert any(ln.startswith("known bug") for ln in lines[:at])
    md = gate_report.markdown(rep)
    main, apart = md.split("### Misuse findings")
    assert MISUSE_SIG not in main and MISUSE_SIG in apart and "| MISUSE, NEW divergence |" in apart
    suite = ET.fromstring(gate_report.junit(rep))
    (case,) = [tc for tc in suite.iter("testcase") if tc.get("classname") == "gradfuzz.deepspeed.misuse"]
    assert case.find("failure").get("message").startswith("MISUSE, NEW divergence")
    known = _gate("known")
    assert known["passed"] is True and "of these, misuse: 1 known" in gate_report.headline(known)


def test_the_fuzz_summary_counts_misuse_findings_on_a_line_of_their_own():
    r = Result(paths={"split.stock": Tally(examples=5, run=5), "deepspeed.zero0.misuse": Tally(examples=5, run=5)})
    r.divergences = [_div("split.stock", BUG_CLASS, BUG_SIG), _div("deepspeed.zero0.misuse", MISUSE_CLASS, MISUSE_SIG)]
    text = fuzz_report.summary(r)
    assert "divergences (1 divergence of 1 signature, in the failing cases):\n  - split.stock value" in text
    assert f"{fuzz_report.MISUSE_HEAD} (1 divergence of 1 signature, in the failing cases):\n  - deepspeed.zero0.misuse value [{MISUSE_SIG}]" in text
    assert "deepspeed.zero0.misuse MISUSE" in text and "split.stock            DIVERGES" in text
    assert [d["finding_class"] for d in fuzz_report.to_json(r)["divergences"]] == [BUG_CLASS, MISUSE_CLASS]
