"""Corpus replay: every saved case on every available path.

A divergence listed in the case's ``meta.expect`` for this torch version is
a known bug and is reported as xfail; anything else must agree with the
oracle. Unavailable paths are reported as skipped with the reason.
"""

import json
import os

import pytest
import torch

from harness.artifacts import corpus
from harness.paths import resolve
from harness.engine.runner import check

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "cases")
FILES = corpus.discover([ROOT])
PATHS = resolve(None)
# Every compile path recompiles per case (seconds each): the default run replays
# on them the cases filed for them (``meta.expect`` names a compile path, or the
# case lives in cases/compile); every case on every compile path is the slow
# test tests/nocover/test_corpus_compile_slow.py.
COMPILE = [p for p in PATHS if p.name.startswith("compile.")]


def _filed_for_compile(file: str) -> bool:
    entry = corpus.load(file)
    return os.path.relpath(file, ROOT).startswith("compile") or any(
        e.get("path", "").startswith("compile") for e in entry.meta.get("expect", []))


PAIRS = [(f, p) for f in FILES for p in PATHS if p not in COMPILE or _filed_for_compile(f)]


def test_corpus_is_not_empty():
    assert any(f.endswith("nested_weight_double_count.json") for f in FILES)


@pytest.mark.parametrize("file, path", PAIRS, ids=lambda x: x.name if hasattr(x, "name") else os.path.relpath(x, ROOT))
def test_replay(file, path):
    available = path.availability()
    if not available.ok:
        pytest.skip(f"{path.name} unavailable here: {available.reason}")
    entry = corpus.load(file)
    reason = path.supports(entry.case)
    if reason is not None:
        pytest.skip(f"outside {path.name}'s contract: {reason}")
    divs = check(entry.case, path)
    if entry.expected_on(path.name, torch.__version__):
        if divs:
            pytest.xfail(f"known bug on torch {torch.__version__}: {divs[0].detail}")
        return  # fixed on this version: the gate reports it as good news
    assert not divs, divs[0].detail


def test_corpus_write_is_atomic_and_round_trips(tmp_path):
    entry = corpus.load(FILES[0])
    target = corpus.save(tmp_path, "split.stock-value-0123456789", entry, repro="print('hi')\n")
    again = corpus.load(target)
    assert again.case == entry.case and again.meta == entry.meta
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize(
    "text, words",
    [
        ("{not json", "not valid JSON (line 1"),
        (json.dumps({"case": {}}), "field gradfuzz_corpus: missing"),
        (json.dumps({"gradfuzz_corpus": 7, "case": {}}), "field gradfuzz_corpus: unknown corpus version 7"),
    ],
)
def test_malformed_corpus_files_name_file_and_field(tmp_path, text, words):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    with pytest.raises(corpus.CorpusError) as info:
        corpus.load(bad)
    assert str(bad) in str(info.value) and words in str(info.value)


def test_ledger_and_case_expectations_agree():
    """Each ledger bug's cases expect exactly the ledger's range on its path,
    and every expectation in a case is backed by a ledger entry."""
    from harness.gate import ledger

    led = ledger.load(os.path.join(ROOT, "ledger.json"))
    backed = set()
    for bug in led.sites:
        assert bug.cases or bug.signatures, f"{bug.id} has nothing to match"
        for rel in bug.cases:
            entry = corpus.load(os.path.join(ROOT, rel))
            expects = [(e["path"], e["torch"], tuple(sorted(e.get("packages", {}).items())))
                       for e in entry.meta.get("expect", [])]
            assert (bug.path, bug.torch, bug.packages) in expects, f"{rel} does not expect {bug.path} {bug.range} as {bug.id} says"
            backed.add((os.path.normpath(rel), bug.path))
    for f in FILES:
        for e in corpus.load(f).meta.get("expect", []):
            assert (os.path.normpath(os.path.relpath(f, ROOT)), e["path"]) in backed, f"{f}: {e['path']} has no ledger entry"
