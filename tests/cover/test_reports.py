"""Reports a reviewer reads in a minute: the verdict first, one row per bug,
at most 40 rows, no path of this machine, no cell cut mid-word, a title and
a repro for each new finding; progress lines within the terminal's width."""

import os
import re
import xml.etree.ElementTree as ET

from harness.cli.progress import PhaseLines, fit, plain_line
from harness.gate import html as gate_html
from harness.gate import report as gate_report
from harness.gate.run import GateReport, Row
from harness.gate.status import STATUSES
from harness.artifacts.text import PROJECT, scrub, shorten

CWD = os.getcwd()
LONG = (f"w0 after backward 1 (seen in {CWD}/harness/engine/check.py and {PROJECT}/harness/paths/split/paths.py): 9 of 9 "
        "elements differ | max abs diff 1.5, max rel diff 1 (first at index (0, 1): expected 1.5, got 3; exact mode)\n"
        + "counted twice over the microbatches " * 12)


def _divergence(i: int) -> dict:
    return {"path": "split.stock", "kind": "value", "param": "w0", "microbatch": 1, "max_abs": 1.5, "max_rel": 1.0,
            "ratio": 2.0, "detail": LONG, "signature": f"split.stock-value-{i:010x}", "flaky": False, "shape": ""}


def _report(new: int = 30, bugs: int = 70) -> dict:
    """A gate record with ``bugs`` known bugs, each on two paths (two rows
    that are one bug), and ``new`` new findings, one signature each."""
    rows = [Row("known", path, LONG, bug=f"bug-{i}", signature=f"{path}-value-{i:010x}",
                source=f"corpus {CWD}/cases/split/case{i}.json", upstream="https://github.com/pytorch/pytorch/issues/1")
            for i in range(bugs) for path in ("split.stock", "pipeline.GPipe.stock")]
    rows += [Row("new", "split.stock", LONG, None, f"split.stock-value-{i:010x}", "fuzz", {"case": i}, _divergence(i))
             for i in range(new)]
    rows.append(Row("unavailable", "graphed.stock", f"needs CUDA (looked in {CWD}/oracles)"))
    return GateReport("2.13.0", rows, examples={"split.stock": 100}, seconds=12.0).to_json()


def _table(md: str) -> list[str]:
    return [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith(("| status", "| ---"))]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_a_hundred_rows_make_at_most_forty_table_rows_and_the_rest_is_counted():
    rep = _report()
    assert len(rep["rows"]) == 171
    md = gate_report.markdown(rep, full=os.path.join(CWD, "gate.json"))
    rows = _table(md)
    assert len(rows) == gate_report.MAX_ROWS == 40
    assert "… and 61 more rows: see gate.json" in md  # 30 new + 70 bugs + 1 unavailable = 101 lines of which 40 shown
    assert md.startswith("## ❌ gradfuzz gate FAILED on torch `2.13.0`")  # the verdict first
    assert "**30 new fail the gate; 140 known, 1 unavailable.**" in md


def test_rows_of_one_bug_on_several_paths_are_one_row_listing_the_paths():
    md = gate_report.markdown(_report(new=0, bugs=3))
    rows = [r for r in _table(md) if r.startswith("| known")]
    assert len(rows) == 3
    assert "`split.stock`, `pipeline.GPipe.stock`" in rows[0] or "`pipeline.GPipe.stock`, `split.stock`" in rows[0]


def test_no_absolute_path_of_this_machine_in_any_report():
    rep = _report(new=5, bugs=5)
    forms = [gate_report.markdown(rep, full=os.path.join(CWD, "gate.json")), gate_report.terminal(rep, width=100),
             gate_report.junit(rep)]
    for text in forms:
        assert CWD + "/" not in text and PROJECT + "/" not in text
        assert "harness/engine/check.py" in text  # made relative, not dropped
    assert scrub(f"{CWD}/cases/split/nested.json") == "cases/split/nested.json"
    assert scrub("/tmp/pytest-7/test_x0/cases/split/nested.json") == "cases/split/nested.json"
    assert "https://github.com/pytorch/pytorch/issues/1" in scrub("see https://github.com/pytorch/pytorch/issues/1")


def test_a_long_detail_is_cut_at_a_word_boundary_with_an_ellipsis_and_pipes_escaped():
    md = gate_report.markdown(_report(new=1, bugs=1))
    for line in _table(md)[:2]:  # the new finding and the known bug, both with the long detail
        assert len(_cells(line)) == 4  # an escaped | does not open a cell
        detail = _cells(line)[3]
        assert detail.endswith("…")
        shown = detail[:-1].replace("\\|", "|")
        whole = " ".join(scrub(LONG).split())
        assert whole.startswith(shown) and whole[len(shown)] in " ,;:"  # the cut falls after a whole word
    assert shorten("counted twice over", 12) == "counted…"
    assert shorten("a" * 30, 10) == "a" * 9 + "…"  # one long word: a hard cut, still marked


def test_a_new_finding_has_a_title_and_a_link_to_its_saved_repro(tmp_path):
    sig = "split.stock-value-0000000000"
    (tmp_path / f"{sig}.json").write_text("{}")
    (tmp_path / f"{sig}.py").write_text("# repro\n")
    rep = _report(new=2, bugs=0)
    row = next(r for r in rep["rows"] if r["status"] == "new")
    assert gate_report.title(row) == "split.stock: w0's grad is 2x eager's after 2 microbatches (value)"
    md = gate_report.markdown(rep, save_dir=str(tmp_path))
    first = next(ln for ln in _table(md) if sig in ln)
    link = os.path.relpath(tmp_path / f"{sig}.py") if str(tmp_path).startswith(CWD) else scrub(str(tmp_path / f"{sig}.py"))
    assert f"[split.stock: w0's grad is 2x eager's after 2 microbatches (value)]({link})" in first
    assert "/tmp/" not in md.replace("…/", "")
    other = next(ln for ln in _table(md) if "split.stock-value-0000000001" in ln)
    assert "(repro not saved)" in other  # no file under the save dir: said, not a dead link
    term = gate_report.terminal(rep, save_dir=str(tmp_path), width=100)
    assert f"repro: python {link}" in term
    suite = ET.fromstring(gate_report.junit(rep, save_dir=str(tmp_path)))
    assert suite.find("properties/property").get("value").startswith("gradfuzz gate FAILED")
    assert any(t.get("name", "").startswith("split.stock: w0's grad is 2x") for t in suite.findall("testcase"))


def test_titles_for_other_kinds():
    err = {"path": "fsdp2.stock", "divergence": {"kind": "error", "microbatch": None, "param": None, "ratio": None,
                                                 "detail": "raised RuntimeError: boom\n at x (the eager oracle ran this case fine)"}}
    assert gate_report.title(err) == "fsdp2.stock: raises RuntimeError: boom where eager runs (error)"
    zero = {"path": "eager", "divergence": {"kind": "value", "param": "input grad x0", "microbatch": 0, "ratio": 0.0,
                                            "detail": ""}}
    assert gate_report.title(zero) == "eager: input grad x0 is zero after 1 microbatch where eager's is not (value)"
    assert gate_report.title({"path": "x", "divergence": None}) is None


def test_every_status_in_the_table_renders_with_its_words():
    """Statuses come from harness.gate.status: one added there shows here."""
    rows = [Row(s, "split.stock", f"detail of {s}", bug=f"b-{s}") for s in STATUSES]
    rep = GateReport("2.13.0", rows).to_json()
    md = gate_report.markdown(rep)
    for s, st in STATUSES.items():
        assert f"| {shorten(st.words, gate_report.CELL).replace('|', chr(92) + '|')} |" in md, s
    assert len(_table(md)) == len(STATUSES)


def test_html_page_has_the_verdict_first_and_at_most_forty_rows():
    page = gate_html.html_page(_report(new=0, bugs=60))
    assert page.index("<h1>gradfuzz gate PASSED") < page.index("<table>")
    assert page.count("<tr class=") == 40 and "… and 21 more rows" in page
    assert CWD + "/" not in page


def test_a_progress_line_from_a_long_per_path_status_stays_within_the_width():
    now = 1000.0
    paths = {f"pipeline.Schedule{i}.stock": {"examples": 100 + i, "run": 100, "skipped": {}, "seconds": 1.0}
             for i in range(80)}
    view = {"now": now, "started": now - 30, "deadline": None, "examples_budget": 500, "workers": 16,
            "paths": paths, "counts": {"s": 2}, "details": {}}
    for width in (60, 80, 100, 200):
        line = plain_line(view, width=width)
        assert len(line) <= width and line.startswith("gradfuzz [fuzz 00:30,"), line
    line = plain_line(view, width=200)
    assert "11160/40000 examples" in line and "left" not in line  # a total met so far: no ETA from it
    line = plain_line(dict(view, planned=40000), width=200)
    assert "11160/40000 examples" in line and "01:17 left" in line  # counted in advance: done/total and an ETA
    assert "slowest: pipeline.Schedule0.stock 100 (3/s)" in line and "more)" in line  # summarised, not dumped
    assert len(fit("x " * 1000, 100)) <= 100


def test_gate_progress_lines_show_phase_count_and_eta_within_the_width():
    t = [0.0]
    lines = PhaseLines(width=80, clock=lambda: t[0])
    shown = []
    for text in ["[selfcheck 1/4] split-double-count: caught (120 examples, 3.0s)",
                 "[selfcheck 4/4] pipeline-stale: caught",
                 "[phase] replay 3/90 corpus cases on 40 paths, ~20s left",
                 "[phase] fuzz target 1/5: split.stock (100 examples)",
                 f"[split.stock] divergence split.stock-value-abc: {LONG}",
                 "[phase] fuzz target 2/5: eager (100 examples)"]:
        t[0] += 10
        shown.append(lines.line(text))
    assert all(len(s) <= 80 for s in shown)
    assert shown[0] == "[selfcheck 1/4] split-double-count: caught (120 examples, 3.0s)"  # one estimate is no ETA
    assert shown[2] == "[phase] replay 3/90 corpus cases on 40 paths"  # its own ETA dropped: 2/90 done is too early
    assert shown[4].startswith("[fuzz] [split.stock] divergence") and CWD not in shown[4]
    assert shown[5] == "[phase] fuzz target 2/5: eager (100 examples)"  # the count's first estimate: not yet
