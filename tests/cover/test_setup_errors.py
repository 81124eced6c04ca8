"""Setup errors are loud and replay sums up honestly.

A setup the user got wrong must exit 2 naming the thing and the fix before
anything runs: an unimportable ``--split-impl`` read as "no divergence" and
the gate PASSED "(1 unavailable)"; run outside the checkout, the ledger was
silently missing and every known bug read "not in ledger". The commands run
as a user runs them, from a folder outside the repository.
"""

import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest

from harness import project
from harness.cli import replay as verdict
from harness.cli.main import build_parser, main
from harness.artifacts.corpus import Entry
from tests.helpers import nested

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BOGUS = "no_such_gradfuzz_impl_xyz"


def gradfuzz(*args, cwd, timeout=300, module="harness"):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


# --- the ledger and corpus come from the installed project, not the cwd -----------------


def test_project_root_is_the_parent_of_the_harness_package():
    assert project.ROOT == ROOT
    assert os.path.isfile(project.LEDGER) and os.path.isdir(project.CORPUS)


def test_gate_outside_the_checkout_reads_the_installed_ledger(tmp_path):
    # --minutes 0: the replay alone, classified against the ledger.
    r = gradfuzz("gate", "--paths", "split", "--minutes", "0", "--no-selfcheck", "--json", "r.json", cwd=tmp_path)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert any(row["bug"] for row in rows), "no row names a ledger bug: the ledger was not read"


def test_replay_outside_the_checkout_replays_the_installed_corpus_and_counts_known(tmp_path):
    r = gradfuzz("replay", "--paths", "split", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"gradfuzz replay: (\d+) known, (\d+) new, (\d+) fixed.*", last)
    assert m and int(m.group(1)) > 0 and m.group(2) == "0", last
    assert "no divergence" not in r.stdout  # after known divergences, never


@pytest.mark.parametrize("argv", [
    ["gate", "--paths", "split", "--minutes", "0", "--no-selfcheck"],
    ["fuzz", "--paths", "split.fixed", "--examples", "1", "--seed", "0"],
    ["ledger", "--paths", "split.fixed"],
])
def test_no_ledger_in_the_installed_project_is_exit_2_naming_it_and_the_fix(argv, tmp_path, monkeypatch, capsys):
    missing = str(tmp_path / "gone" / "ledger.json")
    monkeypatch.setattr(project, "LEDGER", missing)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert missing in err and "--ledger FILE" in err


def test_a_named_ledger_that_does_not_exist_is_exit_2_naming_it(tmp_path, capsys):
    missing = str(tmp_path / "mine.json")
    assert main(["gate", "--ledger", missing, "--paths", "split", "--minutes", "0", "--no-selfcheck"]) == 2
    assert f"--ledger {missing}: no such file" in capsys.readouterr().err


@pytest.mark.parametrize("argv, fix", [
    (["gate", "--paths", "split", "--minutes", "0", "--no-selfcheck"], "--corpus DIR"),
    (["replay", "--paths", "split"], "name the corpus files or directories"),
])
def test_no_corpus_in_the_installed_project_is_exit_2_naming_it(argv, fix, tmp_path, monkeypatch, capsys):
    missing = str(tmp_path / "cases")
    monkeypatch.setattr(project, "CORPUS", missing)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert missing in err and fix in err


# --- the user's own code: an option that cannot be honoured is exit 2, never "unavailable" ---


def test_gate_with_an_unimportable_split_impl_exits_2_and_never_passes(tmp_path):
    r = gradfuzz("gate", "--paths", "split", "--split-impl", BOGUS, "--minutes", "0", "--no-selfcheck", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "PASSED" not in r.stdout and "Traceback" not in r.stderr
    assert f"--split-impl '{BOGUS}'" in r.stderr and f"No module named '{BOGUS}'" in r.stderr
    assert "PYTHONPATH" in r.stderr  # the fix


@pytest.mark.parametrize("argv, words", [
    (["fuzz", "--paths", "split", "--split-impl", BOGUS, "--examples", "1"], [f"No module named '{BOGUS}'"]),
    (["replay", "--paths", "split", "--split-impl", BOGUS], [f"No module named '{BOGUS}'"]),
    (["paths", "--split-impl", "harness.paths:no_such_attr"], ["has no attribute 'no_such_attr'", "fix: make --split-impl"]),
    (["paths", "--split-impl", "harness.paths"], ["lacks stage_backward_input"]),
    (["paths", "--graphed-impl", f"{BOGUS}:f"], ["--graphed-impl", f"No module named '{BOGUS}'"]),
    (["paths", "--dtensor-impl", "os"], ["--dtensor-impl 'os'", "install(params, mesh)"]),
    (["paths", "--path", f"{BOGUS}:p"], ["--path", f"No module named '{BOGUS}'", "fix:"]),
    (["paths", "--path", "harness.paths.split.paths:SplitPath"], ["calling SplitPath(options) raised TypeError", "fix:"]),
    (["paths", "--path", "os:sep"], ["is not a gradfuzz path", "fix:"]),
])
def test_every_implementation_option_that_does_not_load_is_exit_2_with_the_fix(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err


def test_a_path_with_a_wrong_attribute_is_exit_2_without_a_traceback(tmp_path):
    r = gradfuzz("paths", "--path", "harness.paths:no_such_attr", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "has no attribute 'no_such_attr'" in r.stderr and "fix:" in r.stderr


def test_the_pytest_plugin_stops_on_an_unimportable_impl_before_collecting(tmp_path):
    r = gradfuzz("-p", "no:randomly", "-p", "no:cacheprovider", "-q", "--gradfuzz-paths", "split",
                 "--gradfuzz-option", f"split_impl={BOGUS}", cwd=tmp_path, module="pytest")
    assert r.returncode == 4, r.stdout + r.stderr  # pytest's usage error
    assert f"--split-impl '{BOGUS}'" in r.stdout + r.stderr


# --- replay's verdict ---------------------------------------------------------------------


def _expecting(torch_range: str) -> Entry:
    return Entry(nested(), {"expect": [{"path": "split.stock", "torch": torch_range}]})


@pytest.mark.parametrize("torch_range, diverged, want", [
    (">=2.0", True, "known"),
    (">=2.0", False, "not_reproduced"),
    ("<2.0", False, "fixed"),
    ("<2.0", True, "regression"),
    ("", True, "known"),
])
def test_replay_status_of_a_case_expecting_a_bug(torch_range, diverged, want):
    assert verdict.status(_expecting(torch_range), "split.stock", diverged, "2.13.0") == want


def test_replay_status_of_a_case_expecting_nothing_on_the_path():
    assert verdict.status(_expecting(">=2.0"), "split.fixed", True, "2.13.0") == "new"
    assert verdict.status(_expecting(">=2.0"), "split.fixed", False, "2.13.0") is None


def test_replay_line_counts_known_new_fixed_and_any_other_status():
    assert verdict.line(Counter(known=290), 0) == "gradfuzz replay: 290 known, 0 new, 0 fixed (runs of a case on a path)"
    line = verdict.line(Counter({"known": 3, "new": 1, "fixed": 2, "regression": 1, None: 9}), 2)
    assert line.startswith("gradfuzz replay: 3 known, 1 new, 2 fixed, 1 regression, 2 path(s) unavailable")


@pytest.mark.parametrize("command", ["gate", "replay", "fuzz"])
def test_help_says_what_each_exit_code_means(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for code in ("0:", "1:", "2: a setup error"):
        assert code in out.split("exit status:", 1)[1], out
