"""The gate: classification against the ledger, reports, selfcheck."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

from harness.artifacts import corpus
from harness.gate import run as gate
from harness.gate import html as gate_html
from harness.gate import report as gate_report
from harness.gate import ledger
from harness.materialize import probes
from harness.gate.ledger import report_from_json
from harness.artifacts.corpus import CorpusError
from harness.paths import Options, resolve
from harness.case.spec import Case, Input, Node, Param, Use
from harness.gate.versions import table
from tests.helpers import nested

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
V = torch.__version__.split("+")[0]


@pytest.mark.parametrize("spec, version, rel", [
    ("<2.13", "2.11.0", "in"), ("<2.13", "2.13.0", "after"), (">=2.11", "2.10.0", "before"),
    (">=2.11", "2.14.1+cu130", "in"), (">=2.0,<2.12", "2.13.0", "after"),
])
def test_version_relation(spec, version, rel):
    assert ledger.Bug.single("b", "p", spec, "s").sites[0].relation(version) == rel


def _world(tmp_path, torch_range: str | None):
    """A corpus with the nested case and a ledger that does or does not know it."""
    cases = tmp_path / "cases"
    corpus.save(cases / "split", "nested", corpus.Entry(nested(), {"title": "nested"}))
    bugs = [] if torch_range is None else [
        {"id": "canary-bug", "path": "split.stock", "torch": torch_range, "summary": "double count",
         "cases": ["split/nested.json"], "upstream": "https://example.invalid/1"}]
    (cases / "ledger.json").write_text(json.dumps({"gradfuzz_ledger": 1, "signature_scheme": 2, "bugs": bugs}))
    return str(cases), str(cases / "ledger.json")


@pytest.mark.parametrize("impl, torch_range, status, fails", [
    ("harness.paths.split.canaries:double_count_nested", f">={V}", "known_signature_only", False),
    ("harness.paths.split.canaries:double_count_nested", "<2.0", "regression", True),
    ("harness.paths.split.canaries:double_count_nested", None, "new", True),
    ("oracles.split_fixed", "<2.0", "fixed", False),
    ("oracles.split_fixed", f">={V}", "not_reproduced", False),
])
def test_classification(tmp_path, impl, torch_range, status, fails):
    cases, led = _world(tmp_path, torch_range)
    paths = resolve("split.stock", Options(impls=(("split_impl", impl),)))
    report = gate.run_gate(paths, corpus_dirs=[cases], ledger_file=led, minutes=0, run_selfcheck=False)
    assert [r.status for r in report.rows] == [status]
    assert report.failed is fails
    rep = report.to_json()
    assert rep["passed"] is (not fails) and rep["counts"][status] == 1


def _two_places(tmp_path, cases_at_first_only: bool) -> list:
    """The gate's rows for the nested case's bug at two places, split.stock
    (where the canary double-counts) and split.fixed (which agrees), its case
    filed for both or at the first only."""
    cases, led = _world(tmp_path, f">={V}")
    data = json.load(open(led))
    bug, first = data["bugs"][0], {"path": "split.stock", "torch": f">={V}"}
    if cases_at_first_only:
        first["cases"] = bug.pop("cases")
    data["bugs"][0] = {k: v for k, v in bug.items() if k not in ("path", "torch")} | {"places": [
        first, {"path": "split.fixed", "torch": f">={V}"}]}
    open(led, "w").write(json.dumps(data))
    paths = resolve("split.stock,split.fixed",
                    Options(impls=(("split_impl", "harness.paths.split.canaries:double_count_nested"),)))
    return gate.run_gate(paths, corpus_dirs=[cases], ledger_file=led, minutes=0, run_selfcheck=False).rows


def test_a_place_whose_cases_agree_is_not_reproduced_though_another_place_of_its_bug_is(tmp_path):
    """A bug at two places: its case diverges at one and agrees at the other.
    The quiet place gets its own not-reproduced row, not the other's finding."""
    rows = _two_places(tmp_path, cases_at_first_only=False)
    assert sorted((r.status, r.path) for r in rows) == [
        ("known_signature_only", "split.stock"), ("not_reproduced", "split.fixed")], [r.detail for r in rows]


def test_a_place_whose_cases_did_not_run_says_nothing_though_another_place_of_its_bug_ran(tmp_path):
    """The same bug with its case filed at the first place only: nothing ran
    at the second, so it gets no row, not a not-reproduced one."""
    rows = _two_places(tmp_path, cases_at_first_only=True)
    assert [(r.status, r.path) for r in rows] == [("known_signature_only", "split.stock")], [r.detail for r in rows]


def _ledger_world(tmp_path, case_file: str, bug: dict) -> tuple[str, str]:
    """A corpus of one filed case (copied from cases/) under one ledger entry."""
    cases = tmp_path / "cases"
    (cases / os.path.dirname(case_file)).mkdir(parents=True)
    (cases / case_file).write_text(open(os.path.join(ROOT, "cases", case_file)).read())
    led = cases / "ledger.json"
    led.write_text(json.dumps({"gradfuzz_ledger": 1, "signature_scheme": 2, "bugs": [{**bug, "cases": [case_file]}]}))
    return str(cases), str(led)


@pytest.mark.parametrize("workaround, status", [
    ("clone-grads", "known"),  # the view steal's outside workaround removes it: known, causally
    ("optimizer-for-loop", "resembles"),  # a workaround of another bug leaves it: not this bug, fails
    ("none", "known_signature_only"),
])
def test_known_means_the_workaround_removes_it(tmp_path, workaround, status):
    cases, led = _ledger_world(tmp_path, "eager/accumulategrad_stack_alias.json", {
        "id": "steal", "path": "eager.accumulate", "torch": f">={V}", "summary": "view steal", "workaround": workaround})
    report = gate.run_gate(resolve("eager.accumulate"), corpus_dirs=[cases], ledger_file=led, minutes=0,
                           run_selfcheck=False)
    assert {(r.status, r.bug) for r in report.rows} == {(status, "steal")}, [r.detail for r in report.rows]
    assert report.failed is (status == "resembles")


@pytest.mark.parametrize("claims, workaround, status", [
    ("workaround", "clone-grads", "known"),  # its workaround removes it: that bug, whatever the signature
    ("workaround", "optimizer-for-loop", "new"),  # another bug's workaround leaves it wrong: still new
    ("signature", "clone-grads", "new"),  # an entry that claims by signature only takes nothing unrecorded
])
def test_a_bug_that_claims_by_workaround_takes_a_new_signature_its_workaround_removes(tmp_path, claims, workaround,
                                                                                      status):
    """megatron's PP=2 batched-p2p swap shows a new signature on most new cases
    (the swapped tensors mix microbatches); its entry claims by workaround, so
    the gate files an unrecorded divergence under it only where its workaround
    removes it, and otherwise the row stays new and fails the gate."""
    cases, led = _ledger_world(tmp_path, "eager/accumulategrad_stack_alias.json", {
        "id": "steal", "path": "eager.accumulate", "torch": f">={V}", "summary": "view steal",
        "workaround": workaround, "claims": claims})
    data = json.load(open(led))
    data["bugs"][0]["cases"] = []  # the case is in the corpus, its signature in no entry
    open(led, "w").write(json.dumps(data))
    report = gate.run_gate(resolve("eager.accumulate"), corpus_dirs=[cases], ledger_file=led, minutes=0,
                           run_selfcheck=False)
    got = {(r.status, r.bug) for r in report.rows}
    assert got == {(status, "steal" if status == "known" else None)}, [r.detail for r in report.rows]
    assert report.failed is (status == "new")
    if status == "known":
        assert "claimed by steal" in report.rows[0].detail


def test_an_entry_that_claims_by_workaround_needs_one(tmp_path):
    from harness.gate import ledger as ledger_mod

    led = tmp_path / "ledger.json"
    led.write_text(json.dumps({"gradfuzz_ledger": 1, "signature_scheme": 2, "bugs": [
        {"id": "b", "path": "eager.accumulate", "torch": ">=2.0", "summary": "s", "claims": "workaround"}]}))
    with pytest.raises(Exception) as e:
        ledger_mod.load(str(led))
    assert "bugs[0].claims" in str(e.value) and str(led) in str(e.value)


class _SecondBug:
    """eager.accumulate with a second bug the view steal's workaround cannot
    remove: ``where="same"`` zeroes every grad after backward 1 (where the
    steal shows); ``where="stacked"`` does so unless optimizer-for-loop is
    in force (a second ledger bug with a workaround of its own);
    ``where="hidden"`` writes into an input only while the workaround is in
    force (the known bug hid it, as split.twin exposes)."""

    def __init__(self, where: str) -> None:
        from harness.paths.eager.paths import EagerAccumulate

        self.inner, self.where = EagerAccumulate(), where
        self.name, self.contract, self.workarounds = self.inner.name, self.inner.contract, self.inner.workarounds

    def availability(self):
        return self.inner.availability()

    def supports(self, case):
        return None

    def run(self, case):
        from harness.materialize.workarounds import ACTIVE
        from harness.observation import Mutation

        obs = self.inner.run(case)
        if self.where == "same" or self.where == "stacked" and "optimizer-for-loop" not in ACTIVE.get():
            obs.steps[1].grads = {n: g * 0 for n, g in obs.steps[1].grads.items()}
        elif ACTIVE.get():
            obs.mutations.append(Mutation(1, "input x0 of backward 0", 1.0))
        return obs


@pytest.mark.parametrize("where, statuses", [
    ("same", {("resembles", "steal")}),  # still wrong where the steal was: not that bug
    ("hidden", {("known", "steal"), ("new", None)}),  # the steal is known; what its workaround exposes is new
])
def test_a_second_bug_beside_a_known_one_is_never_known(tmp_path, where, statuses):
    cases, led = _ledger_world(tmp_path, "eager/accumulategrad_stack_alias.json", {
        "id": "steal", "path": "eager.accumulate", "torch": f">={V}", "summary": "view steal", "workaround": "clone-grads"})
    report = gate.run_gate([_SecondBug(where)], corpus_dirs=[cases], ledger_file=led, minutes=0, run_selfcheck=False)
    assert {(r.status, r.bug) for r in report.rows} == statuses, [r.detail for r in report.rows]
    assert report.failed


def test_a_signature_before_its_range_is_range_wrong_not_known(tmp_path):
    cases, led = _ledger_world(tmp_path, "eager/accumulategrad_stack_alias.json", {
        "id": "steal", "path": "eager.accumulate", "torch": ">=99", "summary": "view steal", "workaround": "clone-grads"})
    report = gate.run_gate(resolve("eager.accumulate"), corpus_dirs=[cases], ledger_file=led, minutes=0,
                           run_selfcheck=False)
    assert {r.status for r in report.rows} == {"range_wrong"} and report.failed


def test_a_ledger_of_another_signature_scheme_is_refused_and_rescheme_moves_it(tmp_path):
    from harness.gate import audit
    from harness.case.schema import FileError

    f = tmp_path / "ledger.json"
    f.write_text(json.dumps({"gradfuzz_ledger": 1, "bugs": [
        {"id": "x", "path": "split.stock", "torch": "<2.13", "summary": "s", "signatures": ["split.stock-value-0123456789"]}]}))
    with pytest.raises(FileError, match="signature_scheme.*scheme 1.*scheme 2.*--rescheme"):
        ledger.load(str(f))
    assert audit.rescheme(str(f)) and not audit.rescheme(str(f))
    assert ledger.load(str(f)).bugs[0].signatures == ()


def test_reports_render_from_the_json(tmp_path):
    cases, led = _world(tmp_path, None)
    paths = resolve("split.stock", Options(impls=(("split_impl", "harness.paths.split.canaries:double_count_nested"),))) + resolve("split.fixed")
    rep = gate.run_gate(paths, corpus_dirs=[cases], ledger_file=led, minutes=0, run_selfcheck=False).to_json()
    suite = ET.fromstring(gate_report.junit(rep))
    assert suite.get("failures") == "1" and len(suite.findall("testcase")) >= 2
    md = gate_report.markdown(rep)
    row = next(ln for ln in md.splitlines() if ln.startswith("| NEW divergence |"))  # one row per signature
    assert "split.stock: " in row and "(value)" in row and "`split.stock`" in row  # its title and path
    page = gate_html.html_page(rep)
    assert "def forward(v):" in page  # the repro script inline
    try:
        import matplotlib  # noqa: F401
        assert '<img alt="heatmaps" src="data:image/png;base64,' in page
    except ImportError:
        assert "Install the <code>report</code> extra" in page


def test_the_report_times_each_phase_and_a_reader_checks_the_times(tmp_path):
    cases, led = _world(tmp_path, None)
    rep = gate.run_gate(resolve("split.fixed"), corpus_dirs=[cases], ledger_file=led, examples=3,
                        run_selfcheck=False).to_json()
    assert list(rep["phases"]) == ["replay", "fuzz", "workarounds"]
    assert 0 < sum(rep["phases"].values()) <= rep["seconds"] + 0.05
    assert f"replay {rep['phases']['replay']:.0f}s" in gate_report.markdown(rep)
    assert report_from_json(json.loads(json.dumps(rep)), "r.json")["phases"] == rep["phases"]
    with pytest.raises(CorpusError, match=r"r\.json.*phases\['fuzz'\]"):
        report_from_json({**rep, "phases": {"fuzz": "slow"}}, "r.json")


def test_baseline_and_version_table():
    old = {"torch": "2.11.0", "rows": [{"path": "split.stock", "bug": "b1", "signature": None, "detail": "", "status": "known"}]}
    new = {"torch": "2.13.0", "rows": [{"path": "split.stock", "bug": "b1", "signature": None, "detail": "", "status": "fixed"}]}
    lines = gate.compare_baseline(new, old)
    assert "    b1: known -> fixed" in lines
    t = table([new, old])
    assert t.splitlines()[0] == "| row | 2.11.0 | 2.13.0 |"
    assert "| b1 | known | fixed |" in t
    # one row per bug, whichever paths show it; the worst status wins a cell
    other = {"torch": "2.13.0", "rows": [{"path": "pipeline.X.stock", "bug": "b1", "signature": None, "detail": "",
                                          "status": "known"}] + new["rows"]}
    assert "| b1 | known | known |" in table([other, old])


def test_malformed_ledger_names_file_and_field(tmp_path):
    f = tmp_path / "ledger.json"
    f.write_text(json.dumps({"gradfuzz_ledger": 1, "signature_scheme": 2, "bugs": [{"id": "x", "path": "p", "torch": "~~2", "summary": "s"}]}))
    with pytest.raises(corpus.CorpusError, match=r"ledger.json: field bugs\[0\]\.torch"):
        ledger.load(str(f))


def _selfcheck(*extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "harness", "selfcheck", *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_selfcheck_fails_naming_the_canaries_when_detection_is_broken():
    # Two cheap canaries (every canary blunted runs its whole budget: the slow set runs them all).
    r = _selfcheck("--tolerance-slack", "1e30", "--canaries", "double_count_nested,drops_accumulated")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "MISSED: double_count_nested, drops_accumulated" in r.stdout, r.stdout
    assert "NOT CAUGHT: not caught in" in r.stdout


def test_selfcheck_shows_what_each_canary_caught_and_refuses_unknown_names():
    r = _selfcheck("--canaries", "drops_accumulated,double_count_nested", "-n", "2")  # each in a process of its own
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2/2 canaries caught" in r.stdout
    lines = r.stdout.splitlines()
    caught = next(i for i, line in enumerate(lines) if "drops_accumulated" in line and "caught after" in line)
    assert "after backward" in lines[caught + 1], r.stdout  # the caught divergence itself, on the next line
    from harness.canaries import select
    from harness.paths import UsageError

    with pytest.raises(UsageError, match="unknown canary nope.*double_count_nested"):  # the CLI's exit 2
        select("drops_accumulated,nope")


def test_before_the_clamp_a_canary_whose_bug_is_stocks_own_runs_its_fallback_over_fixed(monkeypatch):
    """On torch < 2.13 stock split has the nested double count itself: a
    canary that injects it into stock proves nothing there (removing the
    injection removes nothing), so it must not run against another base; the
    pipeline family falls back to the same bug injected into the fixed stage,
    judged against the fixed path. Canaries whose bug stock lacks keep stock."""
    from harness.canaries import all_canaries, resolve_base

    by_name = {c.name: c for c in all_canaries()}
    assert by_name["double_count_nested"].needs_clamp and not by_name["loses_tied_site"].needs_clamp
    for c in by_name.values():
        assert c.proves_nothing_here() == ""  # torch 2.13+ here
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert "own before torch 2.13" in resolve_base(by_name["double_count_nested"])[1]
    assert resolve_base(by_name["loses_tied_site"])[0].name == "split.stock"
    chain, c = [], by_name["pipeline_pre_clamp"]
    while c is not None:
        chain.append(c)
        c = c.fallback
    assert resolve_base(chain[0])[1] and chain[1].base.endswith(".fixed") and resolve_base(chain[1])[1] == ""


def test_a_bug_seen_on_one_path_is_recognised_by_shape_on_another_it_covers(tmp_path):
    """Ledger entries for a family (every zero-bubble schedule) replay their
    cases only where the layout fits; a fuzz finding of the same shape on a
    sibling path is that bug, not a new one. Outside the entry's paths it is not."""
    from harness.paths.split.paths import SplitPath
    from harness.engine.runner import check
    from harness.gate.evidence import Evidence

    a = SplitPath("split.stock", "harness.paths.split.canaries:double_count_nested", stock_contract=True)
    b = SplitPath("canary.sibling", "harness.paths.split.canaries:double_count_nested", stock_contract=True)
    (da,), (db,) = check(nested(), a)[:1], check(nested(), b)[:1]
    assert da.signature != db.signature and da.shape == db.shape
    led = ledger.Ledger([ledger.Bug.single("fam", "split.stock, canary.sib*", f">={V}", "double count")], str(tmp_path))
    assert Evidence(led, torch.__version__, shapes={("fam", da.shape)}).owner(db).id == "fam"
    assert Evidence(led, torch.__version__, shapes={("fam", "value-0000000000")}).owner(db) is None
    other = ledger.Ledger([ledger.Bug.single("fam", "split.stock", f">={V}", "double count")], str(tmp_path))
    assert Evidence(other, torch.__version__, shapes={("fam", da.shape)}).owner(db) is None


def test_a_case_filed_under_two_bugs_gives_each_divergence_to_the_bug_that_names_it(tmp_path):
    from harness.engine.runner import check

    paths = resolve("split.stock", Options(impls=(("split_impl", "harness.paths.split.canaries:double_count_nested"),)))
    sigs = {d.signature for d in check(nested(), paths[0])}
    cases = tmp_path / "cases"
    corpus.save(cases / "split", "nested", corpus.Entry(nested(), {"title": "nested"}))
    common = {"path": "split.stock", "torch": f">={V}", "cases": ["split/nested.json"]}
    bugs = [{"id": "first", "summary": "listed first", **common},
            {"id": "named", "summary": "names the signature", "signatures": sorted(sigs), **common}]
    (cases / "ledger.json").write_text(json.dumps({"gradfuzz_ledger": 1, "signature_scheme": 2, "bugs": bugs}))
    report = gate.run_gate(paths, corpus_dirs=[str(cases)], ledger_file=str(cases / "ledger.json"), minutes=0,
                           run_selfcheck=False)
    assert {(r.status, r.bug) for r in report.rows} == {("known_signature_only", "named")}


def test_a_case_of_a_later_bug_showing_an_older_bugs_signature_is_that_older_bug(tmp_path):
    """On 2.11 a case filed under a zero-bubble bug that starts at 2.13 shows
    the stale-buffer bug every schedule has; the row goes to the bug that
    affects this torch and records the signature, not NEW under the later one."""
    from harness.engine.runner import check

    paths = resolve("split.stock", Options(impls=(("split_impl", "harness.paths.split.canaries:double_count_nested"),)))
    sigs = sorted({d.signature for d in check(nested(), paths[0])})
    cases = tmp_path / "cases"
    corpus.save(cases / "split", "nested", corpus.Entry(nested(), {"title": "nested"}))
    bugs = [{"id": "later", "path": "split.stock", "torch": ">=99", "summary": "starts later",
             "cases": ["split/nested.json"], "signatures": sigs},
            {"id": "older", "path": "split.stock", "torch": f">={V}", "summary": "affects this torch",
             "signatures": sigs}]
    (cases / "ledger.json").write_text(json.dumps({"gradfuzz_ledger": 1, "signature_scheme": 2, "bugs": bugs}))
    run = lambda: gate.run_gate(paths, corpus_dirs=[str(cases)], ledger_file=str(cases / "ledger.json"),  # noqa: E731
                                minutes=0, run_selfcheck=False)
    assert {(r.status, r.bug) for r in run().rows} == {("known_signature_only", "older")}
    bugs[1]["signatures"] = []  # nothing affecting this torch records it: the later bug, shown too early
    (cases / "ledger.json").write_text(json.dumps({"gradfuzz_ledger": 1, "signature_scheme": 2, "bugs": bugs}))
    assert {(r.status, r.bug) for r in run().rows} == {("range_wrong", "later")}  # its signature, before its range

def test_a_coarse_signature_of_a_bug_whose_cases_agree_here_is_not_a_regression(tmp_path):
    """A ledger bug fixed before this version, whose own case agrees in the
    replay, does not claim a fuzz finding by signature alone: that finding
    is new (it still fails the gate), not the old bug come back."""
    from harness.engine.runner import check

    paths = resolve("split.stock", Options(impls=(("split_impl", "harness.paths.split.canaries:double_count_nested"),)))
    plain = Case(params=(Param("w0", (3, 3)),), inputs=(Input("x0", (2, 3), requires_grad=True),),
                 nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))),), outputs=(Use("n0"),))
    assert not check(plain, paths[0])
    cases = tmp_path / "cases"
    corpus.save(cases / "split", "plain", corpus.Entry(plain, {"title": "agrees"}))
    old = {"id": "old", "path": "split.stock", "torch": "<2.0", "summary": "fixed long ago",
           "cases": ["split/plain.json"], "signatures": sorted({d.signature for d in check(nested(), paths[0])})}
    (cases / "ledger.json").write_text(json.dumps({"gradfuzz_ledger": 1, "signature_scheme": 2, "bugs": [old]}))
    report = gate.run_gate(paths, corpus_dirs=[str(cases)], ledger_file=str(cases / "ledger.json"), minutes=0.1,
                           run_selfcheck=False)
    fuzz = [r for r in report.rows if r.source == "fuzz"]
    assert any(r.signature in old["signatures"] for r in fuzz), [r.detail for r in fuzz]
    assert {r.status for r in fuzz} == {"new"} and report.failed
    assert [r.status for r in report.rows if r.source != "fuzz"] == ["fixed"]


def test_reports_group_a_bug_seen_on_many_paths_into_one_row_and_end_on_the_verdict():
    row = {"status": "known", "bug": "optim-x", "signature": "s", "detail": "d", "source": "fuzz", "upstream": ""}
    rep = {"torch": "2.13.0", "passed": True, "seconds": 3.0, "examples": {"split.stock": 5},
           "counts": {"new": 0, "regression": 0, "known": 31, "fixed": 0, "not_reproduced": 0, "unavailable": 0,
                      "selfcheck": 0},
           "selfcheck": [],
           "rows": [{**row, "path": f"pipeline.S{i}.stock"} for i in range(30)] + [{**row, "path": "split.stock"}]}
    md = gate_report.markdown(rep)
    body = [ln for ln in md.splitlines() if ln.startswith("| known")]
    assert len(body) == 1  # one bug on 31 paths of two families -> one row listing the paths
    assert "| optim-x | `pipeline.S0.stock`, `pipeline.S1.stock`, " in md and " and 27 more |" in md
    term = gate_report.terminal(rep, width=100).splitlines()
    assert term[0].startswith("gradfuzz gate PASSED") and "31 known" in term[0]  # the verdict first
    assert term[-1].startswith("=") and "PASSED (31 known)" in term[-1]  # and last, pytest style
    suite = ET.fromstring(gate_report.junit(rep))
    assert len([t for t in suite.findall("testcase") if not t.get("name").startswith("examples")]) == 1


def test_shrinking_is_bounded_by_counts_not_by_wall_time():
    """Hypothesis's five-minute shrink limit would make a loaded machine's
    findings larger cases with other signatures: the gate's verdict would
    follow the load. The engine lifts it (our budgets bound the run)."""
    import harness.engine.target  # noqa: F401
    from hypothesis.internal.conjecture import engine

    assert engine.MAX_SHRINKING_SECONDS >= 3600


def test_draws_do_not_depend_on_the_literals_of_loaded_modules():
    """The engine turns off Hypothesis's mixing of local modules' literals into
    draws (which made the cases depend on what a process had imported). The
    patch names private parts of Hypothesis and skips itself where they are
    missing; this test is what notices when a Hypothesis release renames them."""
    import harness.engine.target  # noqa: F401
    from hypothesis.internal.conjecture import providers

    assert hasattr(providers, "Constants") and hasattr(providers, "_get_local_constants"), \
        "Hypothesis moved its local-constants pool: update harness.engine.target._no_local_constants"
    local = providers._get_local_constants()
    assert not any(len(getattr(local, f)) for f in ("integers", "floats", "bytes", "strings") if hasattr(local, f))


def test_replay_on_two_processes_gives_the_one_process_rows(tmp_path):
    """gate -n N replays each group of paths in a child process: the rows,
    their order and the counts must be those of one process."""
    def rows(workers):
        rep = gate.run_gate(resolve("split,eager"), corpus_dirs=["cases"], ledger_file="cases/ledger.json", minutes=0,
                            save_dir=str(tmp_path), run_selfcheck=False, workers=workers, options=Options()).to_json()
        return rep["counts"], rep["examples"], [(r["status"], r["path"], r["bug"], r["signature"], r["source"])
                                                for r in rep["rows"]]

    one, two = rows(1), rows(2)
    assert one == two
    assert one[0]["known"] > 0 and one[0]["error"] == 0


def test_a_heavy_group_is_dealt_out_by_cases_on_many_processes():
    """On more than two processes a heavy group (compile, graphed) is split
    into parts by cases, so the replay does not wait on one process; every
    case is in exactly one part, and light groups stay whole."""
    from types import SimpleNamespace

    from harness.engine.replay_pool import units

    heavy = [SimpleNamespace(name=f"compile.{n}", worker=None) for n in ("aot_eager", "inductor")]
    light = [SimpleNamespace(name=f"split.{n}") for n in ("stock", "fixed")]
    got = units(heavy + light, 40, 4)
    parts = [k for k in got if k.startswith("compile#")]
    assert len(parts) == 4 and list(got)[:4] == parts  # heaviest first
    assert sorted(i for k in parts for i in got[k][1]) == list(range(40))
    assert got["split"] == (["split.stock", "split.fixed"], list(range(40)))
    assert units(heavy + light, 40, 2)["compile"][1] == list(range(40))  # two processes: nothing to gain


def test_replay_split_by_cases_gives_the_one_process_results(monkeypatch):
    from harness.engine import replay_pool

    monkeypatch.setattr(replay_pool, "SPLIT_AT", 0)  # every group is "heavy": split.* dealt out by cases
    monkeypatch.setattr(replay_pool, "CASES_PER_PART", 2)
    live = [p for p in resolve("split") if p.availability().ok]
    entries = [corpus.load(f) for f in corpus.discover(["cases/split"])][:9]
    assert len(replay_pool.units(live, len(entries), 3)) > len({replay_pool.job_key(p.name) for p in live})

    def key(rs):
        return [(r.entry.file, r.path.name, r.skipped, [d.signature for d in r.divergences]) for r in rs]

    one = key(replay_pool.replay_on_workers(entries, live, 1, Options()))
    assert one == key(replay_pool.replay_on_workers(entries, live, 3, Options()))
    assert any(sigs for *_, sigs in one)


def test_a_replay_child_that_dies_is_named_and_its_groups_taken_by_the_others(tmp_path):
    """A case that kills its replay child: the group it was on is reported
    stopped, with the child's exit, and the groups it had not reached still
    replay on the next children (one worker here, so a fresh one starts)."""
    from harness.engine.replay_pool import ReplayError, replay_on_workers

    options = Options(impls=(("split_impl", "tests.standins:exits"),))
    live = [p for p in resolve("split,checkpoint.reentrant", options) if p.availability().ok]
    entries = [corpus.load(f) for f in corpus.discover(["cases/split"])]
    with pytest.raises(ReplayError) as e:
        replay_on_workers(entries, live, 1, options)
    why = str(e.value)
    dead = [p.name for p in live if p.name.startswith("split.")]
    assert f"replay of {', '.join(dead)} stopped after" in why and "exited 3" in why, why
    assert "checkpoint" not in why.split("(replay-")[0], why  # taken after split's, on a fresh child


def test_a_racy_known_bug_counts_once_per_path_whatever_signatures_it_showed():
    """Two runs of one seed: a racy bug showed one signature in the first and
    two in the second (seen on two-rank zero bubble). Counted per (status, bug,
    path) both runs give the same rows; new signatures stay one row each."""
    from harness.gate.run import Row, one_row_per_bug

    def run(sigs):
        rows = [Row("known", "pipeline.X.ranks2.stock", "d", bug="racy", signature=s) for s in sigs]
        rows += [Row("new", "split.stock", "d", signature=s) for s in ("n1", "n2")]
        return [(r.status, r.bug, r.path) for r in one_row_per_bug(rows)]

    assert run(["s1"]) == run(["s1", "s2"]) == run(["s2", "s1"])
    assert len(run(["s1"])) == 3


def test_a_fuzz_phase_stopped_by_sigterm_fails_the_gate(tmp_path, monkeypatch):
    """``gate -n``'s workers stop between examples on SIGTERM (what a CI
    timeout sends) and the summary still prints; a run whose budget did not
    run out cannot pass (a 2.11 gate on a GPU machine printed PASSED after its timeout)."""
    import signal

    from harness.cli import fuzz as fuzz_command
    from harness.engine.result import Result, Tally

    def stopped(args, options, n, display, unavailable, total=None):
        r = Result()
        r.paths["split.fixed"] = Tally(examples=3)
        return r, {"interrupted": True, "signal": signal.SIGTERM}

    monkeypatch.setattr(fuzz_command, "_parallel", stopped)
    cases, led = _world(tmp_path, None)
    paths = resolve("split.fixed")
    report = gate.run_gate(paths, corpus_dirs=[cases], ledger_file=led, examples=10, run_selfcheck=False,
                           fuzzer=fuzz_command.on_workers(Options(), "2"))
    errors = [r for r in report.rows if r.status == "error"]
    assert report.failed and len(errors) == 1
    assert "SIGTERM after 3 example(s)" in errors[0].detail and "10 example(s) per target" in errors[0].detail


@pytest.mark.parametrize("workaround, status", [("clone-grads", "known"), ("none", "known_signature_only")])
def test_a_workaround_that_leaves_the_case_wrong_hands_it_to_another_bug_its_signature_fits(tmp_path, workaround,
                                                                                          status):
    """A coarse signature fits two bugs of one path; the first one's workaround
    leaves the case wrong, so it is not that one: it goes to the other (known
    if its own workaround removes it), and the gate does not fail on a
    resemblance that another entry explains."""
    case_file = "eager/accumulategrad_stack_alias.json"
    from harness.artifacts import corpus
    from harness.engine.check import check

    path = resolve("eager.accumulate")[0]
    sigs = sorted({d.signature for d in check(corpus.load(os.path.join(ROOT, "cases", case_file)).case, path)})
    cases, led = _ledger_world(tmp_path, case_file, {
        "id": "wrong", "path": "eager.accumulate", "torch": f">={V}", "summary": "s", "workaround": "optimizer-for-loop"})
    data = json.load(open(led))
    data["bugs"][0]["signatures"] = sigs  # both record it; the case is filed under "wrong", which the match picks
    data["bugs"].append({"id": "right", "path": "eager.accumulate", "torch": f">={V}", "summary": "view steal",
                         "cases": [], "signatures": sigs, "workaround": workaround})
    open(led, "w").write(json.dumps(data))
    report = gate.run_gate(resolve("eager.accumulate"), corpus_dirs=[cases], ledger_file=led, minutes=0,
                           run_selfcheck=False)
    assert {(r.status, r.bug) for r in report.rows} == {(status, "right")}, [r.detail for r in report.rows]
    assert not report.failed and "not wrong" in report.rows[0].detail


def test_two_ledger_bugs_stacked_in_one_case_are_known_when_both_checks_remove_it(tmp_path):
    """Each bug's workaround alone leaves the case wrong where the other bug
    shows (each alone reads "resembles"); both in force, it agrees: known,
    the row's bug stacked with the other (DualPipeV on two ranks: the view
    steal doubling two microbatches beside the split drop of the last)."""
    from harness.artifacts import corpus
    from harness.engine.check import check

    case_file = "eager/accumulategrad_stack_alias.json"
    path = _SecondBug("stacked")
    sigs = sorted({d.signature for d in check(corpus.load(os.path.join(ROOT, "cases", case_file)).case, path)})
    cases, led = _ledger_world(tmp_path, case_file, {
        "id": "steal", "path": "eager.accumulate", "torch": f">={V}", "summary": "view steal", "workaround": "clone-grads"})
    data = json.load(open(led))
    data["bugs"][0]["signatures"] = sigs  # a coarse signature both entries record, as 9846c5ed28 is
    data["bugs"].append({"id": "zeroes", "path": "eager.accumulate", "torch": f">={V}", "summary": "zeroes backward 1",
                         "cases": [], "signatures": sigs, "workaround": "optimizer-for-loop"})
    open(led, "w").write(json.dumps(data))
    report = gate.run_gate([path], corpus_dirs=[cases], ledger_file=led, minutes=0, run_selfcheck=False)
    assert {(r.status, r.bug) for r in report.rows} == {("known", "steal")}, [r.detail for r in report.rows]
    assert not report.failed and "stacked with zeroes" in report.rows[0].detail


class _TwoShown(_SecondBug):
    """eager.accumulate with w1's grad doubled and w2's missing after the
    first backward, unless either of two fix probes is in force: each probe
    removes both divergences (as the split hook probe also removes the
    nested double count on 2.11)."""

    PROBES = ("tensor-split-indices-as-list", "matmul-vector-squeeze-out-of-place")

    def __init__(self) -> None:
        super().__init__("probes")
        self.workarounds = ()  # only the probes remove what it shows

    def run(self, case):
        from harness.materialize.workarounds import ACTIVE

        obs = self.inner.run(case)
        if not ACTIVE.get() & set(self.PROBES):
            obs.steps[0].grads = {n: None if n == "w2" else g * 2 if n == "w1" else g for n, g in obs.steps[0].grads.items()}
        return obs


def test_a_probe_that_also_removes_another_bug_s_divergence_defers_to_that_bug(tmp_path):
    """The row's bug's probe removes its divergence and another bug's too: no
    evidence for the row's bug. The other bug, whose entry records the row's
    signature and whose probe removes the row and nothing but its own, is
    the one it is known as (a fuzzed case on 2.11: w1 doubled, filed by
    signature under the hook bug, is the nested double count)."""
    from harness.artifacts import corpus
    from harness.engine.check import check

    case_file, path = "split/multi_output_intermediate_grads_summed.json", _TwoShown()
    for probe in path.PROBES:
        if probes.available(probe) is not None:
            pytest.skip(f"{probe} does not apply to torch {V}")
    divs = {d.param: d.signature for d in check(corpus.load(os.path.join(ROOT, "cases", case_file)).case, path)}
    assert set(divs) == {"w1", "w2"} and divs["w1"] != divs["w2"], divs
    cases, led = _ledger_world(tmp_path, case_file, {
        "id": "hook", "path": "eager.accumulate", "torch": f">={V}", "summary": "s", "signatures": [divs["w1"]],
        "workaround": "none", "probe": path.PROBES[0]})
    data = json.load(open(led))
    data["bugs"].append({"id": "nested", "path": "eager.accumulate", "torch": f">={V}", "summary": "s", "cases": [],
                         "signatures": [divs["w1"], divs["w2"]], "workaround": "none", "probe": path.PROBES[1]})
    open(led, "w").write(json.dumps(data))
    report = gate.run_gate([path], corpus_dirs=[cases], ledger_file=led, minutes=0, run_selfcheck=False)
    assert {(r.status, r.bug) for r in report.rows} == {("known_probe", "nested")}, [r.detail for r in report.rows]
    assert "not hook" in next(r.detail for r in report.rows if r.signature == divs["w1"])


def test_the_gate_json_carries_no_path_of_this_machine_in_a_crashed_childs_traceback(tmp_path, monkeypatch):
    """A SIGSEGV in a replay child lands in an error row with the child's
    log: the JSON is an artifact others read, so the home and temporary
    directories go, while a case (data) is written as it was."""
    from harness.cli.main import main

    home, temp = os.path.expanduser("~"), "/tmp/gradfuzz-replay-k3j2/"
    trace = (f"Fatal Python error: Segmentation fault\n  File \"{home}/venv/lib/site.py\", line 3\n"
             f"  File \"{temp}replay-0.log\", line 1\n  File \"{ROOT}/harness/engine/check.py\", line 9")
    case = {"note": "/data/kept/as/written/"}
    rep = gate.GateReport(torch.__version__, [gate.Row("error", "replay", trace, source="replay", case=case)])
    monkeypatch.setattr(gate, "run_gate", lambda *a, **k: rep)
    monkeypatch.chdir(tmp_path)
    assert main(["gate", "--paths", "split.fixed", "--corpus", "--no-selfcheck", "--minutes", "0"]) == 1
    text = (tmp_path / ".gradfuzz" / "gate" / "gate.json").read_text()
    row = json.loads(text)["rows"][0]
    assert home not in text and "/tmp/" not in text and ROOT not in text
    assert 'File "~/venv/lib/site.py"' in row["detail"] and "harness/engine/check.py" in row["detail"]
    assert "replay-0.log" in row["detail"] and row["case"] == case


def test_unavailable_paths_are_listed_by_reason_however_many_rows_overflow():
    """The README gate on 2 cores had 57 groups: the 40 shown were bugs, and
    "32 unavailable" came with no reason at all, left in "… and 17 more rows"."""
    from harness.gate.run import GateReport, Row

    cuda, ds = "needs CUDA: a CPU-only build", "deepspeed is not installed here"
    rows = [Row("known", "split.stock", "d", bug=f"bug-{i:03d}") for i in range(gate_report.MAX_ROWS + 5)]
    rows += [Row("unavailable", "graphed.stock", cuda), Row("unavailable", "deepspeed.zero1.stock", ds),
             Row("unavailable", "deepspeed.zero2.stock", ds)]
    rep = GateReport("2.13.0", rows).to_json()
    lines = gate_report.terminal(rep, full="gate.json").splitlines()
    assert f"path unavailable x2 ({ds}): deepspeed.zero1.stock, deepspeed.zero2.stock" in lines[:5]
    assert f"path unavailable ({cuda}): graphed.stock" in lines[:5]
    assert sum(ln.startswith("known bug") for ln in lines) == gate_report.MAX_ROWS - 2  # within the limit
    over = "… and 7 more rows: see gate.json; their bugs: " + ", ".join(f"[bug-{i:03d}]" for i in range(38, 45))
    assert over in lines  # every bug id in the log, the rows past the limit by their ids
    md = gate_report.markdown(rep, full="gate.json").splitlines()
    assert len([ln for ln in md if ln.startswith("| path unavailable")]) == 2
    assert len([ln for ln in md if ln.startswith("| ")]) - 2 == gate_report.MAX_ROWS  # header and rule aside


def test_the_gate_counts_unjudged_cases_apart_in_every_report(tmp_path):
    """A fuzzed case a wrong grad would agree on ran and passed nothing:
    the report says how many, per path, and a baseline holding a count that
    is not one is refused naming the field."""
    from harness.engine.result import Result, Tally

    def fuzzer(paths, **kw):
        r = Result()
        r.paths["split.fixed"] = Tally(examples=40, run=40, unjudged=3)
        return r

    cases, led = _world(tmp_path, None)
    report = gate.run_gate(resolve("split.fixed"), corpus_dirs=[cases], ledger_file=led, examples=40,
                           run_selfcheck=False, fuzzer=fuzzer)
    rep = report.to_json()
    assert rep["unjudged"] == {"split.fixed": 3}
    assert "(3 unjudged: a wrong grad would agree)" in gate_report.terminal(rep, width=250)
    assert "3 unjudged" in gate_report.junit(rep)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**rep, "unjudged": {"split.fixed": "3"}}))
    with pytest.raises(CorpusError, match="unjudged"):
        ledger.load_report(str(bad))
