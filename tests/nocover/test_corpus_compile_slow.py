"""Every corpus case on every compile path (the default run replays only the
cases filed for them: each compile path recompiles per case)."""

import os

import pytest

from tests.cover.test_corpus import COMPILE, FILES, ROOT, test_replay

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("path", COMPILE, ids=lambda p: p.name)
@pytest.mark.parametrize("file", FILES, ids=lambda f: os.path.relpath(f, ROOT))
def test_replay_on_compile_paths(file, path):
    test_replay(file, path)
