"""gradfuzz: differential gradient fuzzing for PyTorch machinery.

The public names are the few a user needs; everything else under
``harness.*`` may move. ``tests/cover/test_api.py`` lists them so that an
accidental export (or removal) fails CI.
"""

from harness.observation import Divergence, Observation
from harness.paths import Options, Path, register_path, resolve
from harness.engine.runner import check, fuzz, replay
from harness.case.spec import Case

__all__ = ["Case", "Divergence", "Observation", "Options", "Path", "check", "fuzz", "register_path", "replay", "resolve"]
