"""The toy family, registered the way a third party registers one: by the
one entry point line below, in a package's metadata on the path. Nothing
outside this folder names it, and every gradfuzz command then sees it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.artifacts.repro import script
from tests.cover.test_conformance import check_path
from tests.helpers import nested
from tests.twice.data import Split
from tests.twice.paths import Twice

REGISTRATION = "twice = tests.twice:FAMILY"  # the line a package's pyproject.toml puts under gradfuzz.paths
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """An environment whose Python sees one more installed package: the toy family's metadata."""
    site = tmp_path_factory.mktemp("site")
    info = site / "gradfuzz_twice-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gradfuzz-twice\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[gradfuzz.paths]\n{REGISTRATION}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}


def gradfuzz(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_the_entry_point_line_brings_in_paths_and_canary(env, tmp_path):
    listed = gradfuzz(env, tmp_path, "paths", "--paths", "twice")
    assert listed.returncode == 0 and "twice.halves" in listed.stdout and "available" in listed.stdout, listed.stderr
    checked = gradfuzz(env, tmp_path, "selfcheck", "--canaries", "twice_forgets_half")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "twice_forgets_half" in checked.stdout and "caught" in checked.stdout


def test_fuzzing_the_toy_family_agrees_with_the_oracle(env, tmp_path):
    """Seed 1: seed 0's 40 draws include x @ stack([w0, w1]).sum(0), where the
    toy's two backwards meet torch's AccumulateGrad view steal (the ledger's
    accumulategrad-steals-views, 1.5x on both weights): a torch bug, not the toy's."""
    run = gradfuzz(env, tmp_path, "fuzz", "--paths", "twice", "--examples", "40", "--seed", "1")
    assert run.returncode == 0 and "40 run" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


def test_coverage_traces_the_machinery_it_declares(env, tmp_path):
    """``Family.machinery`` is all ``--coverage`` needs: no table outside this folder names it."""
    run = gradfuzz(env, tmp_path, "fuzz", "--paths", "twice", "--examples", "5", "--seed", "1", "--coverage")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("machinery coverage [twice]")), "")
    assert line and not line.startswith("machinery coverage [twice]: 0 lines"), run.stdout[-2000:]


def _corpus_file(tmp_path: Path, parts: int) -> Path:
    import json

    from harness.artifacts.corpus import Entry

    data = Entry(nested(microbatches=2), {}, "").to_json()
    data["case"]["family"] = {"twice": {"version": 1, "parts": parts}}
    file = tmp_path / f"parts{parts}.json"
    file.write_text(json.dumps(data))
    return file


def test_its_part_of_the_case_is_read_and_checked_by_the_family(env, tmp_path):
    """The case spec has a ``twice`` namespace only where the family is registered, validated by it."""
    four = gradfuzz(env, tmp_path, "replay", str(_corpus_file(tmp_path, 4)), "--paths", "twice")
    assert four.returncode == 0, four.stdout + four.stderr
    three = gradfuzz(env, tmp_path, "replay", str(_corpus_file(tmp_path, 3)), "--paths", "twice")
    assert three.returncode == 2 and "case.family.twice.parts" in three.stderr and "2 or 4" in three.stderr
    plain = {**os.environ, "PYTHONPATH": str(ROOT)}
    unknown = gradfuzz(plain, tmp_path, "replay", str(_corpus_file(tmp_path, 4)))
    assert unknown.returncode == 2 and "case.family.twice" in unknown.stderr and "no installed family" in unknown.stderr


def test_the_path_conforms_and_its_script_agrees(tmp_path):
    path = Twice()
    check_path(path)
    case = nested(microbatches=2)
    file = tmp_path / "repro.py"
    file.write_text(script(case, path.name, path.repro(case)))
    done = subprocess.run([sys.executable, str(file)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "agrees" in done.stdout, done.stdout + done.stderr


def test_without_the_line_no_command_knows_it(tmp_path):
    """The registration line is what makes it exist: the same run without it does not see it."""
    plain = {**os.environ, "PYTHONPATH": str(ROOT)}
    listed = gradfuzz(plain, tmp_path, "paths", "--paths", "twice")
    assert listed.returncode == 2 and "unknown path 'twice'" in listed.stderr


def test_on_the_command_line_its_case_data_is_read_too(tmp_path):
    """``--path tests.twice:FAMILY`` (no entry point): a finding that carries
    the family's part of the case is still written and read back."""
    from harness.case.spec import Case
    from harness.paths import Options, resolve

    (path,) = resolve("twice", Options(extra=("tests.twice:FAMILY",)))
    case = nested(microbatches=2).with_data("twice", Split(4))
    assert Case.loads(case.dumps()) == case and path.name == "twice.halves"
