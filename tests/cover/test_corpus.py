"""Corpus replay: every saved case on every available path.

A divergence listed in the case's ``meta.expect`` for this torch version is
a known bug and is reported as xfail; anything else must agree with the
oracle. Only the pairs that can run here are tests; the others (a path
unavailable here, a case outside a path's contract) are counted by reason.
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


CANDIDATES = [(f, p) for f in FILES for p in PATHS if p not in COMPILE or _filed_for_compile(f)]


def _runnable(pairs: list) -> tuple[list, dict[str, int]]:
    """The (file, path) pairs that can run here, and the others counted by
    why: thousands of skipped pairs (a path unavailable here, a case outside
    its contract) drowned a test run's summary, one line each."""
    available = {p.name: p.availability() for _, p in pairs}
    cases = {f: corpus.load(f).case for f, _ in pairs}
    runs, left_out = [], {}
    for f, p in pairs:
        why = ("unavailable here" if not available[p.name].ok else
               "outside the path's contract" if p.supports(cases[f]) is not None else None)
        if why is None:
            runs.append((f, p))
        else:
            left_out[why] = left_out.get(why, 0) + 1
    return runs, left_out


PAIRS, LEFT_OUT = _runnable(CANDIDATES)


def test_corpus_is_not_empty():
    assert any(f.endswith("nested_weight_double_count.json") for f in FILES)


def test_pairs_that_cannot_run_here_are_counted_in_one_line():
    """Not one skipped test per pair: a count per reason, in one line."""
    assert len(PAIRS) + sum(LEFT_OUT.values()) == len(CANDIDATES)
    print(f"corpus replay: {len(PAIRS)} (case, path) pairs run; not run: "
          + ", ".join(f"{n} {why}" for why, n in sorted(LEFT_OUT.items())))


@pytest.mark.parametrize("file, path", PAIRS, ids=lambda x: x.name if hasattr(x, "name") else os.path.relpath(x, ROOT))
def test_replay(file, path):
    entry = corpus.load(file)
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
