"""What every path must do, third-party ones included: run this suite
against yours with ``pytest tests/cover/test_conformance.py --gradfuzz-paths``
(or import ``check_path`` from here)."""

import ast

import pytest

from harness.observation import Observation
from harness.artifacts.repro import script
from harness.paths import Availability, Path, Repro, families, resolve
from tests.helpers import nested


def check_path(path) -> None:
    assert isinstance(path, Path)
    assert isinstance(path.name, str) and "." in path.name
    a = path.availability()
    assert isinstance(a, Availability) and (a.ok or a.reason), "an unavailable path says why"
    if not a.ok:
        return
    case = nested(microbatches=2)
    assert path.supports(case) is None or isinstance(path.supports(case), str)
    r = path.repro(case)
    templates = {"schedule", "none"} | {t for f in families() for t in f.scripts}
    assert isinstance(r, Repro) and r.template in templates, f"no registered family writes {r.template!r} scripts"
    ast.parse(script(case, path.name, r))  # the standalone script is valid Python
    if path.supports(case) is None:
        obs = path.run(case)
        assert isinstance(obs, Observation) and obs.path == path.name
        assert obs.failure is not None or len(obs.steps) == case.schedule.backwards


@pytest.mark.parametrize("path", resolve(None), ids=lambda p: p.name)
def test_path_conforms(path):
    check_path(path)
