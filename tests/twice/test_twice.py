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
from tests.twice.path import Twice

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
    run = gradfuzz(env, tmp_path, "fuzz", "--paths", "twice", "--examples", "40", "--seed", "0")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


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
