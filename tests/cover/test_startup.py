"""Start-up builds only what a command names.

``resolve`` builds only the families whose declared ``prefixes`` can make a
selected name, so these check that the narrow build picks exactly what the
full registry would, that every built-in family keeps to its prefixes, and
that listing paths evaluates no path property (a pipeline path's
``contract`` starts a worker pool).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.paths import Options, all_paths, families, is_path, resolve
from harness.paths.base import Contract

SELECTIONS = ["split.stock", "split", "checkpoint.fixed", "ddp", "fsdp2.fixed", "ddp.fixed,split.fixed",
              "eager,split,dtensor", "compile.aot_eager", "pipeline.GPipe", "graphed.fixed"]


@pytest.fixture(scope="module")
def every_path() -> list[str]:
    return [p.name for p in all_paths(Options())]


def test_builtin_families_keep_to_their_prefixes() -> None:
    from harness.paths import _family_paths

    for f in families():
        assert f.prefixes, f"{f.name} declares no prefixes: every selection builds it"
        for p in _family_paths(f, Options()):
            assert p.name.split(".")[0] in f.prefixes, (f.name, p.name)


@pytest.mark.parametrize("selection", SELECTIONS)
def test_narrow_resolve_picks_what_the_full_registry_picks(selection: str, every_path: list[str]) -> None:
    want: list[str] = []
    for w in selection.split(","):
        want += [n for n in every_path if (n == w or n.startswith(w + ".")) and n not in want]
    assert [p.name for p in resolve(selection)] == want


def test_unknown_name_still_lists_every_path(every_path: list[str]) -> None:
    from harness.paths import UsageError

    with pytest.raises(UsageError) as e:
        resolve("split.stock,nosuch")
    assert all(n in str(e.value) for n in every_path)


def test_resolving_split_does_not_import_pipelining() -> None:
    code = ("import sys; from harness.paths import resolve; resolve('split.stock'); "
            "print('torch.distributed.pipelining' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


def test_listing_the_pipeline_paths_does_not_import_pipelining() -> None:
    """Listing the pipeline paths (``gradfuzz paths``) reads the package's
    ``__all__``; the classes are imported where a pipeline path runs."""
    code = ("import sys; from harness.paths import resolve; ps = resolve('pipeline'); "
            "print(sum(p.name.startswith('pipeline.') for p in ps), 'torch.distributed.pipelining' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    count, imported = out.strip().splitlines()[-1].split()
    assert int(count) > 0 and imported == "False"


def test_the_schedule_names_are_the_schedules_torch_exports() -> None:
    from harness.paths.pipeline.rank import discover, schedule_names

    assert sorted(schedule_names()) == sorted(discover())


def test_is_path_evaluates_no_property() -> None:
    class Probing:
        name = "probing.stock"

        @property
        def contract(self) -> Contract:
            raise AssertionError("a property was evaluated")

        def availability(self): ...
        def supports(self, case): ...
        def run(self, case): ...
        def repro(self, case): ...

    assert is_path(Probing())
    assert not is_path(object())
