"""The command line, run as a user runs it: a real subprocess."""

import json
import os
import subprocess
import sys

import pytest

from harness.case.vocab import SCHEMA_VERSION
from tests.helpers import nested

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def gradfuzz(*args, cwd=ROOT, timeout=300):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_paths_lists_every_path_with_availability():
    r = gradfuzz("paths")
    assert r.returncode == 0
    for name in ("eager.accumulate", "split.stock", "split.fixed"):
        assert name in r.stdout


def test_unknown_path_is_a_usage_error():
    r = gradfuzz("fuzz", "--paths", "nope", "--examples", "1")
    assert r.returncode == 2 and "unknown path 'nope'" in r.stderr


def _case_file(tmp_path, data) -> str:
    f = tmp_path / "case.json"
    f.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(f)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: "{oops", "not valid JSON"),
        (lambda: {"gradfuzz_corpus": 1, "case": {**nested().to_json(), "version": 3}}, "field case.version: unknown case schema version 3"),
        (lambda: {"gradfuzz_corpus": 1, "case": {**nested().to_json(), "nodes": [{"name": "n0", "op": "fft", "args": [], "attrs": []}]}},
         "field case.nodes[0].op: unknown op 'fft'"),
    ],
)
def test_replay_of_a_malformed_case_exits_2_naming_file_and_field(tmp_path, make, words):
    f = _case_file(tmp_path, make())
    r = gradfuzz("replay", f)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f in r.stderr and words in r.stderr


def test_fuzz_finds_saves_and_the_repro_script_shows_it(tmp_path):
    out = tmp_path / "found"
    report = tmp_path / "r.json"
    r = gradfuzz("fuzz", "--paths", "split.stock", "--split-impl", "harness.paths.split.canaries:drops_accumulated",
                 "--examples", "60", "--seed", "1", "--save", str(out), "--json", str(report), "--mode", "exact")
    assert r.returncode == 1, r.stdout + r.stderr
    data = json.loads(report.read_text())
    d = data["divergences"][0]
    assert d["path"] == "split.stock" and d["kind"] == "value" and d["case"]["version"] == SCHEMA_VERSION
    assert set(d) >= {"path", "kind", "param", "microbatch", "max_abs", "max_rel", "ratio", "signature", "case"}
    scripts = sorted(out.glob("*.py"))
    assert scripts and sorted(out.glob("*.json"))
    # The standalone script: plain python, prints expected against actual, exits 1.
    run = subprocess.run([sys.executable, str(scripts[0])], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "expected" in run.stdout and "DIVERGES" in run.stdout
    # repro re-runs the saved case on the path it was found on
    again = gradfuzz("repro", str(sorted(out.glob("*.json"))[0]), "--split-impl", "harness.paths.split.canaries:drops_accumulated")
    assert again.returncode == 1 and "DIVERGES" in again.stdout


def test_replay_of_the_shipped_corpus_passes_end_to_end():
    # The command end to end on the in-process families; every (case, path) pair of every
    # family is replayed by tests/cover/test_corpus.py, the compile family's in the slow set.
    r = gradfuzz("replay", "cases", "--paths", "split,eager,checkpoint")
    assert r.returncode == 0, r.stdout + r.stderr
    fixed = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("split.fixed "))
    assert " run: " in fixed and " agree" in fixed and " new" not in fixed, fixed  # its runs by verdict


def test_version_json_only_where_honoured_and_repro_script_alone_on_stdout(tmp_path, capsys):
    from harness.cli.main import build_parser, main

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--version"])
    assert "gradfuzz" in capsys.readouterr().out
    for command in (["paths"], ["repro", "x.json"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(command + ["--json", "r.json"])
    capsys.readouterr()
    case = os.path.join(ROOT, "cases", "split", "nested_weight_double_count.json")
    main(["repro", case, "--paths", "split.fixed", "--script"])
    out = capsys.readouterr()
    compile(out.out, "repro.py", "exec")  # stdout is the script alone: `> r.py` runs as is
    assert "split.fixed: agrees" in out.err


@pytest.mark.parametrize("path, verdict", [("eager.accumulate", "DIVERGES"), ("split.fixed", "agrees")])
def test_a_schedule_script_clips_as_the_case_does(tmp_path, path, verdict):
    """The view steal seen only through clip_grad_norm_ (two grads sharing one
    buffer are scaled twice): a script that left the clip out said 'agrees'."""
    from harness.artifacts.corpus import load
    from harness.artifacts.repro import script
    from harness.paths import resolve

    entry = load(os.path.join(ROOT, "cases", "compile", "clip_stack_alias_scaled_twice.json"))
    (p,) = resolve(path)
    file = tmp_path / "repro.py"
    file.write_text(script(entry.case, p.name, p.repro(entry.case)))
    run = subprocess.run([sys.executable, str(file)], capture_output=True, text=True, timeout=120)
    assert f": {verdict} (" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.returncode == (1 if verdict == "DIVERGES" else 0)


def test_a_gate_with_a_fuzz_budget_piped_to_a_log_shows_whole_lines_and_says_where_its_reports_are(tmp_path):
    """The gate as CI runs it: stdout and stderr to pipes, no $COLUMNS, a
    fuzz phase after the replay. No line is cut, each row's bug id is in
    the log, the reports it names exist, and no progress line claims an
    ETA it cannot know or reads "0/s"."""
    from harness.artifacts.text import ELLIPSIS

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    r = subprocess.run([sys.executable, "-m", "harness", "gate", "--paths", "split.fixed", "--examples", "2",
                        "--no-selfcheck"], cwd=tmp_path, env={**env, "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    out, err = r.stdout.splitlines(), r.stderr.splitlines()
    assert not [ln for ln in out + err if ln.rstrip().endswith(ELLIPSIS)]
    rep = json.loads((tmp_path / ".gradfuzz" / "gate" / "gate.json").read_text())
    assert rep["examples"]["split.fixed"] > 2  # the replay's cases and the fuzz phase's examples
    for bug in {row["bug"] for row in rep["rows"] if row.get("bug")}:
        assert f"[{bug}]" in r.stdout, bug
    reports = next(ln for ln in out if ln.startswith("reports: "))
    for name in (".gradfuzz/gate/gate.json", ".gradfuzz/gate/gate.md"):
        assert name in reports and (tmp_path / name).exists()
    assert out[-1].startswith("=") and ("PASSED" in out[-1] or "FAILED" in out[-1])
    assert any(ln.startswith("[phase] fuzz target 1/1") for ln in err), err
    assert not [ln for ln in err if "0/s" in ln or "~0s left" in ln or "00:00 left" in ln]
