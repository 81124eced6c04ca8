"""One ledger entry per bug: places, the refused repeated id, and what
reads and writes the ledger in place (``gradfuzz ledger --write``)."""

from __future__ import annotations

import json
import os

import pytest

from harness.case.schema import FileError
from harness.cli.main import main
from harness.gate import audit, ledger

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SIG = "split.stock-value-0123456789"


def _file(tmp_path, bugs) -> str:
    f = tmp_path / "ledger.json"
    f.write_text(json.dumps({"gradfuzz_ledger": 1, "signature_scheme": ledger.SIGNATURE_SCHEME, "bugs": bugs}))
    return str(f)


TWO_PLACES = {"id": "b", "summary": "one bug", "upstream": "u", "cases": ["split/a.json"], "places": [
    {"path": "split.stock", "torch": ">=2.11", "signatures": [SIG], "workaround": "split-clone-adopted"},
    {"path": "dtensor.*", "torch": "<2.13", "note": "through DTensor", "cases": ["dtensor/b.json"]}]}


def test_the_shipped_ledger_holds_one_entry_per_bug():
    led = ledger.load(os.path.join(ROOT, "cases", "ledger.json"))
    ids = [b.id for b in led.bugs]
    assert len(ids) == len(set(ids))
    sgd = led.bug("optim-sgd-nesterov-foreach-writes-grad")
    assert len(sgd.places) > 1 and sgd.covers("fsdp2.stock") and sgd.covers("eager.accumulate")
    rms = led.bug("rms-norm-cpu-eps-added-in-place")  # one root cause, two machineries
    assert rms.covers("checkpoint.selective.inverse.stock") and rms.covers("dtensor.stock")


def test_a_bug_with_places_gives_each_path_its_place(tmp_path):
    led = ledger.load(_file(tmp_path, [TWO_PLACES]))
    (bug,) = led.bugs
    assert [s.path for s in led.sites] == ["split.stock", "dtensor.*"]
    at = led.by_id("b", "dtensor.stock")
    assert (at.torch, at.workaround, at.cases, at.signatures) == ("<2.13", "none", ("split/a.json", "dtensor/b.json"), ())
    assert at.summary == "one bug (through DTensor)" and at.upstream == "u"
    assert led.match("split.stock", SIG).workaround == "split-clone-adopted"
    assert led.match("dtensor.stock", SIG) is None  # a place's signatures are its own
    assert bug.range == "torch >=2.11; torch <2.13" and bug.all_cases == ("split/a.json", "dtensor/b.json")
    assert ledger.from_json(ledger.to_json(led), led.root + "/ledger.json").bugs == led.bugs  # round trip


def test_a_bug_on_one_set_of_paths_writes_its_place_inline(tmp_path):
    flat = {"id": "f", "path": "split.stock", "torch": "<2.13", "summary": "s", "cases": ["x.json"], "signatures": [SIG]}
    led = ledger.load(_file(tmp_path, [flat]))
    assert led.sites[0].path == "split.stock" and led.sites[0].cases == ("x.json",)
    out = ledger.to_json(led)["bugs"][0]
    assert "places" not in out and out["path"] == "split.stock" and out["cases"] == ["x.json"]


@pytest.mark.parametrize("bugs, field, words", [
    ([TWO_PLACES, {"id": "b", "path": "eager.accumulate", "torch": ">=2.11", "summary": "again"}],
     "bugs[1].id", "is bugs[0]'s id too: a bug is one entry"),
    ([{**TWO_PLACES, "path": "split.stock"}], "bugs[0].path", "lists its places in places"),
    ([{**TWO_PLACES, "places": []}], "bugs[0].places", "no place"),
    ([{"id": "n", "summary": "s", "torch": "<2"}], "bugs[0].path", "missing field"),
    ([{**TWO_PLACES, "places": TWO_PLACES["places"] + [{"path": "split.stock", "torch": "<2"}]}],
     "bugs[0].places[2].path", "places[0]'s path too"),
    ([{**TWO_PLACES, "places": [{"path": "p", "torch": "<2", "claims": "workaround"}]}],
     "bugs[0].places[0].claims", "needs a workaround"),
    ([{**TWO_PLACES, "places": [{"path": "p", "torch": "<2", "summary": "s"}]}], "bugs[0].places[0].summary",
     "unknown field"),
])
def test_a_malformed_entry_is_refused_naming_the_file_and_field(tmp_path, bugs, field, words):
    f = _file(tmp_path, bugs)
    with pytest.raises(FileError) as e:
        ledger.load(f)
    assert f in str(e.value) and f"field {field}:" in str(e.value) and words in str(e.value)


def test_the_cli_refuses_a_repeated_id_with_exit_2(tmp_path, capsys):
    f = _file(tmp_path, [TWO_PLACES, {**TWO_PLACES, "summary": "the same bug filed twice"}])
    assert main(["gate", "--ledger", f, "--paths", "split", "--minutes", "0", "--no-selfcheck", "--corpus"]) == 2
    err = capsys.readouterr().err
    assert "ledger.json: field bugs[1].id: 'b' is bugs[0]'s id too" in err


def test_record_and_rescheme_write_into_the_place_covering_the_path(tmp_path):
    flat = {"id": "f", "path": "eager.accumulate", "torch": ">=2.11", "summary": "s"}
    f = _file(tmp_path, [TWO_PLACES, flat])
    new = "dtensor.stock-value-abcdefabcd"
    problems = [audit.Problem("unrecorded", "b", "dtensor.stock", new), audit.Problem("unrecorded", "f", "eager.accumulate", SIG)]
    assert audit.record(f, problems) == 2
    led = ledger.load(f)
    assert led.by_id("b", "dtensor.stock").signatures == (new,) and led.by_id("b", "split.stock").signatures == (SIG,)
    assert led.by_id("f", "eager.accumulate").signatures == (SIG,)
    data = json.load(open(f))
    data["signature_scheme"] = 1
    open(f, "w").write(json.dumps(data))
    assert audit.rescheme(f)
    assert all(not s.signatures for s in ledger.load(f).sites)
