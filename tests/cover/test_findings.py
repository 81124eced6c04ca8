"""Findings saved as they happen: one file per signature, counts, the smaller case,
two writers at once, idempotent merge."""

import json
import multiprocessing
import os

import pytest
import torch

from harness.observation import Divergence
from harness.artifacts import corpus
from harness.artifacts import findings
from harness.engine.database import MaskingDatabase
from harness.case.spec import Case
from hypothesis.database import InMemoryExampleDatabase
from tests.helpers import nested


def _entry(case: Case, title: str = "t") -> corpus.Entry:
    return corpus.Entry(case, {"title": title, "found_with": {"path": "split.stock"}})


def _bigger(case: Case) -> Case:
    from dataclasses import replace

    from harness.case.spec import Node, Use

    extra = Node(f"n{len(case.nodes)}", "relu", (Use(case.outputs[0].ref),))
    return replace(case, nodes=case.nodes + (extra,), outputs=(Use(extra.name),))


def test_same_signature_bumps_the_count_and_keeps_the_smaller_case(tmp_path):
    small = nested()
    big = _bigger(small)
    r1 = findings.record(tmp_path, "split.stock-value-aaaaaaaaaa", _entry(big, "big"), "print('big')\n")
    assert r1.new and r1.count == 1
    r2 = findings.record(tmp_path, "split.stock-value-aaaaaaaaaa", _entry(small, "small"), "print('small')\n")
    assert not r2.new and r2.count == 2 and r2.replaced
    r3 = findings.record(tmp_path, "split.stock-value-aaaaaaaaaa", _entry(big, "big again"), "print('big again')\n")
    assert r3.count == 3 and not r3.replaced
    e = corpus.load(tmp_path / "split.stock-value-aaaaaaaaaa.json")
    assert e.case == small and e.meta["title"] == "small" and e.meta["count"] == 3
    assert (tmp_path / "split.stock-value-aaaaaaaaaa.py").read_text() == "print('small')\n"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["split.stock-value-aaaaaaaaaa.json", "split.stock-value-aaaaaaaaaa.py"]


def _writer(args):
    directory, worker, n = args
    case = nested()
    for i in range(n):
        findings.record(directory, f"split.stock-value-000000000{i % 3}", _entry(case if (i + worker) % 2 else _bigger(case)), f"# {worker} {i}\n")
    return findings.writer_id()


def test_two_writers_on_one_directory_lose_nothing(tmp_path):
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        writers = pool.map(_writer, [(str(tmp_path), 0, 30), (str(tmp_path), 1, 30)])
    assert len(set(writers)) == 2
    files = sorted(tmp_path.glob("*.json"))
    assert [f.name for f in files] == ["split.stock-value-0000000000.json", "split.stock-value-0000000001.json", "split.stock-value-0000000002.json"]
    total = 0
    for f in files:
        e = corpus.load(f)  # every file parses: no torn writes
        assert e.case == nested()  # the smaller case won wherever both were recorded
        assert sum(e.meta["counts"].values()) == e.meta["count"]
        total += e.meta["count"]
    assert total == 60
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_merge_adds_other_corpora_and_merging_twice_changes_nothing(tmp_path):
    a, b, into = tmp_path / "a", tmp_path / "b", tmp_path / "into"
    for _ in range(2):
        findings.record(a, "split.stock-value-cccccccccc", _entry(_bigger(nested())), "# a\n")
    findings._writer = None  # another machine
    findings.record(b, "split.stock-value-cccccccccc", _entry(nested()), "# b\n")
    findings.record(b, "split.stock-value-dddddddddd", _entry(nested()), "# b\n")
    s1 = findings.merge([str(a), str(b)], str(into))
    assert s1["counts"] == {"split.stock-value-cccccccccc": 3, "split.stock-value-dddddddddd": 1} and s1["new"] == 2
    s2 = findings.merge([str(a), str(b)], str(into))
    assert s2["counts"] == {"split.stock-value-cccccccccc": 3, "split.stock-value-dddddddddd": 1} and s2["new"] == 0
    assert corpus.load(into / "split.stock-value-cccccccccc.json").case == nested()


def test_masking_database_keeps_examples_that_pass_only_because_they_are_known():
    inner = InMemoryExampleDatabase()
    db = MaskingDatabase(inner)
    db.save(b"k", b"v")
    db.masked = True
    db.delete(b"k", b"v")
    db.move(b"k", b"k2", b"v")
    assert list(inner.fetch(b"k")) == [b"v"]
    db.masked = False
    db.delete(b"k", b"v")
    assert list(inner.fetch(b"k")) == []


def _db_session(tmp_path, seed):
    from harness.paths.split.paths import SplitPath
    from harness.engine.session import fuzz

    path = SplitPath("split.stock", "harness.paths.split.canaries:drops_accumulated", stock_contract=True)
    return fuzz([path], examples=40, seed=seed, save_dir=str(tmp_path / "found"), exact=True, db=str(tmp_path / "db"))


def test_a_failure_saved_yesterday_is_replayed_first_today(tmp_path):
    """Directory database: the second session replays the saved failures
    before it draws anything, and reports each as replayed."""
    first = _db_session(tmp_path, 1)
    assert first.counts and not any(d.get("replayed") for d in first.details.values())
    second = _db_session(tmp_path, 2)
    assert set(first.details) <= set(second.details)
    assert all(second.details[s].get("replayed") for s in first.details), second.details
    assert all(t.replayed > 0 for t in second.result.paths.values())
    for sig in first.details:
        saved = json.loads((tmp_path / "found" / f"{sig}.json").read_text())
        assert saved["meta"]["count"] == 2  # once per session: the replay's find, not the stream's again
    assert os.path.isdir(tmp_path / "db")


def test_the_database_adds_finds_but_never_changes_the_seeded_stream(tmp_path):
    """Same seed and budget, run again in the same folder: the saved failures
    are replayed apart, so the examples, the counts and the divergences of the
    seeded stream are those of the cold start (5,318 vs 5,322
    examples). The replay may add finds (examples Hypothesis saved while
    shrinking can show other signatures), after the stream's and marked."""
    cold = _db_session(tmp_path, 1)
    warm = _db_session(tmp_path, 1)
    tallies = lambda s: {n: (t.examples, t.run, dict(t.skipped)) for n, t in s.result.paths.items()}  # noqa: E731
    divs = lambda s: [(d.path, d.signature, d.microbatch, d.detail) for d in s.result.divergences]  # noqa: E731
    assert tallies(warm) == tallies(cold)
    assert divs(warm)[:len(divs(cold))] == divs(cold)
    added = set(warm.counts) - set(cold.counts)
    assert {s: warm.counts[s] for s in cold.counts} == cold.counts
    assert all(warm.details[s].get("replayed") for s in added)
    assert all(t.replayed > 0 for t in warm.result.paths.values()) and not any(
        t.replayed for t in cold.result.paths.values())


def test_findings_folders_are_not_replayed_as_corpus(tmp_path):
    """The README's two commands in order: findings the gate saved must not
    turn the next replay red. A folder a fuzzer writes into carries its lock
    file; discovery passes over it from a parent and says so, and reads it
    when it is named."""
    import shutil

    from harness.cli.main import build_parser
    from harness.artifacts import findings

    cases = tmp_path / "cases"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "..", "..", "cases", "split"), cases / "split")
    found = cases / "found"
    entry = corpus.Entry(nested(), {"title": "t"})
    findings.record(str(found), "split.stock-value-0123456789", entry, "print('repro')\n")
    skipped: list[str] = []
    files = corpus.discover([cases], skipped)
    assert files and not any("found" in f for f in files)
    assert skipped == [str(found)]
    assert corpus.discover([found]) == [str(found / "split.stock-value-0123456789.json")]
    for command in ("fuzz", "gate"):
        assert build_parser().parse_args([command]).save == os.path.join(".gradfuzz", "found")


def test_fuzz_findings_are_labelled_with_their_ledger_bug_or_as_not_in_it(tmp_path):
    from harness.engine.session import Session
    from harness.engine.target import Finding
    from harness.gate.ledger import labeller
    from harness.paths import UsageError, resolve

    from harness.gate.ledger import load

    file = os.path.join(os.path.dirname(__file__), "..", "..", "cases", "ledger.json")
    label = labeller(file)
    sig = load(file).by_id("accumulategrad-steals-views", "eager.accumulate").signatures[0]
    # a signature alone never says plain "known": the gate runs the workaround
    assert label("eager.accumulate", sig).startswith("resembles accumulategrad-steals-views (signature;")
    assert label("split.fixed", sig) == "not in ledger"
    with pytest.raises(UsageError, match="none.json: no such file"):  # never an empty ledger: known bugs would read new
        labeller(str(tmp_path / "none.json"))
    events: list[str] = []
    s = Session(save_dir=None, on_event=events.append, label=label)
    d = Divergence("eager.accumulate", "value", "w0", 0, 1.0, 1.0, 2.0, "counted twice", signature=sig)
    s.on_finding(Finding(resolve("eager.accumulate")[0], nested(), [d], False, 3, 0.1))
    assert s.details[d.signature]["ledger"].startswith("resembles accumulategrad-steals-views")
    assert "(resembles accumulategrad-steals-views" in events[-1]


def test_an_explanation_from_a_rank_deficient_system_is_the_same_on_every_replay():
    """A backward whose own grad is zero makes the explanation's system
    rank-deficient; the signature must not depend on what the solver's
    workspace held before (it flapped between two signatures in one process)."""
    from harness.engine.check import CaseCheck
    from harness.paths import resolve

    entry = corpus.load(os.path.join("cases", "split", "sign_flip_hook_chunk_cat_batch1.json"))
    (path,) = resolve("split.stock")
    seen = set()
    junk = []
    for i in range(20):
        junk.append(torch.randn(7 + i, 3))  # a different heap under the solver each time
        seen.update(d.signature for d in CaseCheck(entry.case).run(path))
    assert seen == {"split.stock-value-38a79323ac"}, seen
