"""A key written twice in one JSON object is refused, in every file gradfuzz
reads: a reviewer reading the first value would approve a file whose last
value is what runs. Exit 2, naming the file and the key's field path."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from harness.artifacts import corpus
from harness.case import schema as sc
from harness.case.spec import SpecError
from harness.cli.main import main
from harness.gate import ledger

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CASE = os.path.join(ROOT, "cases", "split", "nested_weight_double_count.json")


@pytest.mark.parametrize("text, field, key, times", [
    ('{"a": 1, "a": 2}', "a", "a", 2),
    ('{"bugs": [{"id": "x"}, {"id": "y", "path": "p", "path": "q"}]}', "bugs[1].path", "path", 2),
    ('[{"x": {"y": 1, "y": 1, "y": 3}}]', "[0].x.y", "y", 3),
    ('{"a": {"b": 1, "b": 2}, "a": 3}', "a", "a", 2),  # the inner repeat went with the dropped value
])
def test_a_repeated_key_is_a_spec_error_naming_its_field(text, field, key, times):
    with pytest.raises(SpecError) as e:
        sc.parse_json(text, "ledger")
    assert e.value.where == field and f"holds {key!r} {times} times" in str(e.value)


def test_the_same_text_with_each_key_once_parses():
    assert sc.parse_json('{"a": {"b": 1}, "c": [{"b": 2}, {"b": 3}]}', "x") == {"a": {"b": 1}, "c": [{"b": 2}, {"b": 3}]}


def _twice(text: str, key: str, value: str) -> str:
    """``text`` (indented JSON) with ``"key": value`` written again after the first ``"key"`` line."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.strip().startswith(f'"{key}"'))
    indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
    return "\n".join(lines[:i + 1] + [f'{indent}"{key}": {value},'] + lines[i + 1:])


def test_a_corpus_file_with_a_repeated_key_is_refused(tmp_path, capsys):
    f = tmp_path / "case.json"
    f.write_text(_twice(open(CASE).read(), "dtype", '"float64"'))
    with pytest.raises(corpus.CorpusError, match=r"case\.json: field case\.dtype: duplicate key"):
        corpus.load(str(f))
    assert main(["replay", str(f), "--paths", "split.fixed"]) == 2
    assert "field case.dtype: duplicate key: this object holds 'dtype' 2 times" in capsys.readouterr().err


def test_a_ledger_with_a_repeated_key_is_refused(tmp_path, capsys):
    text = open(os.path.join(ROOT, "cases", "ledger.json")).read()
    f = tmp_path / "ledger.json"
    f.write_text(_twice(text, "torch", '">=2.0"'))
    where = "bugs[0].places[0].torch" if "places" in json.loads(text)["bugs"][0] else "bugs[0].torch"
    with pytest.raises(sc.FileError, match=r"ledger\.json: field " + re.escape(where) + ": duplicate key"):
        ledger.load(str(f))
    assert main(["gate", "--ledger", str(f), "--paths", "split", "--minutes", "0", "--no-selfcheck", "--corpus"]) == 2
    assert f"field {where}: duplicate key" in capsys.readouterr().err


def test_a_gate_report_with_a_repeated_key_is_refused(tmp_path, capsys):
    f = tmp_path / "gate.json"
    f.write_text('{"schema": 1, "torch": "2.13.0", "torch": "2.11.0", "rows": []}')
    assert main(["table", str(f)]) == 2
    assert "gate.json: field torch: duplicate key" in capsys.readouterr().err


def test_a_finding_file_with_a_repeated_key_is_not_linked(tmp_path):
    """The gate links a new row to the finding file saved for it; a file it
    could not load as a finding is not one to point a person at."""
    from harness.gate.report import _saved_by_signature

    meta = {"signature": "split.stock-value-0123456789"}
    (tmp_path / "a.json").write_text(json.dumps({"meta": meta}))
    (tmp_path / "b.json").write_text('{"meta": {"signature": "split.stock-value-abcdefabcd"}, "meta": {}}')
    assert list(_saved_by_signature(str(tmp_path))) == ["split.stock-value-0123456789"]
