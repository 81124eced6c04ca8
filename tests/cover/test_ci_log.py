"""What a CI log shows: the gate's output read where it runs, in a file, not
on a terminal. A log cannot be widened, so a line cut there loses its end
(a bug id, a phase's time) for good."""

import json
import os
import subprocess
import sys

from harness.artifacts.text import ELLIPSIS
from harness.cli.progress import PhaseLines, line_width, plain_line
from harness.gate import report as gate_report
from harness.gate.run import GateReport, Row

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def gradfuzz(*args, cwd, timeout=300):
    """The CLI with stdout and stderr to pipes, as in CI, and no ``$COLUMNS``."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = ROOT
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_gate_piped_to_a_file_cuts_no_line_and_shows_every_bug_id_whole(tmp_path):
    r = gradfuzz("gate", "--paths", "split", "--minutes", "0", "--no-selfcheck", cwd=tmp_path)
    full = tmp_path / ".gradfuzz" / "gate" / "gate.json"  # written by default, and named
    assert r.returncode in (0, 1) and full.exists(), r.stderr[-3000:]
    assert r.stdout.splitlines()[-3:-1] == ["reports: .gradfuzz/gate/gate.json (every row), .gradfuzz/gate/gate.md",
                                            "findings: none written this run (they go to .gradfuzz/found/)"]
    lines = (r.stdout + r.stderr).splitlines()
    cut = [ln for ln in lines if ln.rstrip().endswith(ELLIPSIS)]
    assert not cut, cut
    rows = json.loads(full.read_text())["rows"]
    bugs = {row["bug"] for row in rows if row.get("bug")}
    assert bugs, "the split replay shows ledger bugs on every torch the ledger covers"
    for bug in bugs:
        assert f"[{bug}]" in r.stdout, bug
    # Lines longer than a terminal's 100 columns exist and are whole: the test can fail.
    assert max(len(ln) for ln in r.stdout.splitlines()) > 100


def test_a_report_row_with_a_long_bug_id_is_whole_without_a_width_and_cut_with_one():
    bug = "split-" + "-".join(["weights-never-meet-an-input"] * 5)
    rep = GateReport("2.13.0", [Row("known_signature_only", f"split.stock{i}", "detail " * 40, bug=bug)
                                for i in range(3)], seconds=1414.0,
                     phases={"self-check": 37.0, "replay": 600.0, "fuzz": 770.0, "workarounds": 7.0}).to_json()
    whole = gate_report.terminal(rep, width=None)
    assert f"[{bug}] on split.stock0, split.stock1, split.stock2" in whole
    assert "workarounds 7s 0%" in whole
    assert not [ln for ln in whole.splitlines() if ln.endswith(ELLIPSIS)]
    narrow = gate_report.terminal(rep, width=100).splitlines()
    assert max(map(len, narrow)) <= 100 and any(ln.endswith(ELLIPSIS) for ln in narrow)


class _Pipe:
    def isatty(self) -> bool:
        return False


def test_progress_lines_to_a_log_are_whole(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert line_width(_Pipe()) is None
    monkeypatch.setenv("COLUMNS", "120")
    assert line_width(_Pipe()) == 120  # asked for: a width
    monkeypatch.delenv("COLUMNS")
    long = "[selfcheck 5/21] graphed_static_grad_views: skipped (unavailable here: needs CUDA: " + "x " * 80 + "end)"
    shown = PhaseLines(stream=_Pipe()).line(long)
    assert shown.endswith("end)") and not shown.endswith(ELLIPSIS)
    paths = {f"pipeline.Schedule{i}.stock": {"examples": 10 + i} for i in range(80)}
    view = {"now": 100.0, "started": 70.0, "examples_budget": 20, "paths": paths, "counts": {}, "details": {}}
    line = plain_line(view, None)
    assert "slowest: pipeline.Schedule0.stock 10" in line and "more)" in line  # summarised, not 80 paths


def test_skipped_canaries_and_unavailable_paths_show_one_line_per_reason_naming_each():
    from harness.gate.selfcheck import CanaryResult

    cuda, ds = "needs CUDA: torch 2.13.0+cpu is a CPU-only build", "deepspeed is not installed here: pip install x"
    rows = [Row("unavailable", f"deepspeed.zero{i}.stock", ds) for i in range(4)] + [
        Row("unavailable", "graphed.stock", cuda), Row("unavailable", "graphed.fixed", cuda)]
    sc = [CanaryResult(n, False, None, 0.0, "", skipped=f"unavailable here: {cuda}") for n in ("g1", "g2")]
    sc += [CanaryResult("m1", False, None, 0.0, "", skipped="unavailable here: megatron-core is not installed"),
           CanaryResult("s1", True, 3, 0.1, "caught it")]
    rep = GateReport("2.13.0", rows, selfcheck=sc).to_json()
    lines = gate_report.terminal(rep).splitlines()
    assert "self-check 1/4 canaries caught, 3 skipped" in lines[1]
    assert f"self-check skipped 2 canaries (unavailable here: {cuda}): g1, g2" in lines
    assert "self-check skipped 1 canary (unavailable here: megatron-core is not installed): m1" in lines
    assert f"path unavailable x4 ({ds}): " + ", ".join(f"deepspeed.zero{i}.stock" for i in range(4)) in lines
    assert f"path unavailable x2 ({cuda}): graphed.fixed, graphed.stock" in lines
    md = gate_report.markdown(rep)
    assert f"- self-check skipped 2 canaries (unavailable here: {cuda}): g1, g2" in md
    assert len([ln for ln in md.splitlines() if ln.startswith("| path unavailable")]) == 2  # one row per reason


def test_rows_past_the_limit_are_counted_after_the_rows_shown_and_pointed_at_a_report_that_opens(tmp_path):
    rows = [Row("known", "split.stock", "d", bug=f"bug-{i:03d}") for i in range(gate_report.MAX_ROWS + 5)]
    rep = GateReport("2.13.0", rows).to_json()
    full = tmp_path / "out" / "gate.json"
    lines = gate_report.terminal(rep, full=str(full), notes=["reports: here"]).splitlines()
    over = next(i for i, ln in enumerate(lines) if "5 more rows" in ln)
    assert over > max(i for i, ln in enumerate(lines) if ln.startswith("known bug"))  # after the rows it counts
    assert lines[over + 1:] == ["reports: here", gate_report.verdict(rep)]
    md_file = tmp_path / "out" / "md" / "gate.md"
    md = gate_report.markdown(rep, full=str(full), at=str(md_file))
    assert f"{ELLIPSIS} and 5 more rows: see ../gate.json" in md  # from the Markdown's folder
    assert (md_file.parent / "../gate.json").resolve() == full.resolve()


def test_findings_say_where_they_went_and_an_unknown_path_gets_the_names_it_is_close_to(tmp_path, monkeypatch):
    import pytest

    from harness.cli.report import findings_note
    from harness.cli.pathnames import resolve_paths
    from harness.paths import UsageError

    monkeypatch.chdir(tmp_path)
    found = tmp_path / ".gradfuzz" / "found"
    files = [str(found / f"split.stock-value-{i}.json") for i in range(3)]
    assert findings_note(str(found), files) == ("findings: 3 written this run in .gradfuzz/found/ (each with its .py "
                                                "script; replay them all: gradfuzz replay .gradfuzz/found/)")
    with pytest.raises(UsageError) as e:
        resolve_paths("split.fixed,split.stok")
    assert "unknown path 'split.stok': did you mean 'split.stock'" in str(e.value)
    assert "split.fixed," not in str(e.value)  # no list of every path
    with pytest.raises(UsageError, match=r"unknown path 'zzz': families: .*split"):
        resolve_paths(["zzz"])
    assert [p.name for p in resolve_paths("split.fixed")] == ["split.fixed"]


def test_paths_columns_line_up_however_long_a_name_is(capsys):
    from harness.cli.main import main

    assert main(["paths"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert max(len(ln.split()[0]) for ln in rows) > 22  # long names exist: the test can fail
    starts = {len(ln) - len(ln[len(ln.split()[0]):].lstrip()) for ln in rows}
    assert len(starts) == 1, starts  # the state column starts at one offset on every row


def test_replay_path_lines_count_runs_by_verdict_and_add_up_to_the_total():
    from collections import Counter

    from harness.cli import report
    from harness.engine.result import Result, Tally

    r = Result(paths={name: Tally(run=18) for name in ("split.stock", "pipeline.ZBVZeroBubble.ranks2.stock")})
    verdicts = {"split.stock": Counter(known=11, fixed=7), "pipeline.ZBVZeroBubble.ranks2.stock": Counter(agree=18)}
    text = report.summary(r, verdicts=verdicts)
    wide = len("pipeline.ZBVZeroBubble.ranks2.stock")
    assert f"  {'split.stock':<{wide}} 18 run: 11 known, 7 fixed" in text  # 11 + 7 = 18, as the total says
    assert "  pipeline.ZBVZeroBubble.ranks2.stock 18 run: 18 agree" in text
    assert "known bug" not in text


def test_the_test_standins_compile_without_a_syntax_warning():
    import warnings

    with open(os.path.join(ROOT, "tests", "standins.py")) as f:
        source = f.read()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile(source, "standins.py", "exec")


def test_baseline_and_ledger_compare_only_the_selected_paths(capsys):
    from harness.cli.main import main
    from harness.gate.run import compare_baseline

    row = lambda path, bug, status: {"path": path, "bug": bug, "signature": None, "detail": "", "status": status}  # noqa: E731
    old = {"torch": "2.11.0", "rows": [row("split.stock", "b1", "known"), row("ddp.stock", "b2", "known"),
                                       row("split.twin, pipeline.*ZeroBubble*.stock", "b3", "known")]}
    new = {"torch": "2.13.0", "rows": [row("split.stock", "b1", "fixed")]}
    every = compare_baseline(new, old)
    assert "    b2: known -> absent" in every  # no selection: absent is a change
    some = compare_baseline(new, old, ["split.stock", "pipeline.ZBVZeroBubble.stock"])
    assert "    b1: known -> fixed" in some and "    b3: known -> absent" in some  # a pattern covering a selected path
    assert not any("b2" in ln or ln.startswith("  ddp.stock") for ln in some)
    assert "(1 baseline row(s) of paths outside --paths not compared)" in some[0]
    main(["ledger", "--paths", "split"])
    out = capsys.readouterr().out
    assert "no path matching" not in out and "places on paths outside --paths split not checked" in out


def test_the_gates_self_check_runs_the_canaries_of_the_selected_families():
    """``gate --paths split`` ran all 21 canaries (DeepSpeed's, the GPU ones
    skipped with their reasons among them); it runs split's, and says how
    many others it left. With every path, every canary, as before."""
    from harness.canaries import all_canaries, for_paths
    from harness.paths import families, resolve

    everything = [p.name for p in resolve(None)]
    assert [c.name for c in for_paths(everything)] == [c.name for c in all_canaries()]
    split = {c.name for f in families() if f.name == "split" for c in f.canaries()}
    assert split and {c.name for c in for_paths([p.name for p in resolve("split")])} == split
    ddp = {c.name for c in for_paths(["ddp.fixed"])}
    assert ddp and ddp == {c.name for f in families() if f.name == "parallel" for c in f.canaries()}
    assert for_paths([]) == []
