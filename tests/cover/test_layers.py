"""The data flow is enforced, not hoped for: import-linter's contracts in
pyproject.toml (layers from the CLI down to the case spec) hold, no two
modules of harness/ and oracles/ import each other, even indirectly, and no
built-in family imports another (the families read from the registration
table, so a new family is checked without a list to extend)."""

import os
import pathlib
import shutil
import subprocess
import sys

import grimp


def test_import_linter_contracts_hold():
    r = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "BROKEN" not in r.stdout and "KEPT" in r.stdout


def _cycles(graph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    adj = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in adj:
        if root in index:
            continue
        work = [(root, iter(adj[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(adj.get(w, ()))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_cycles():
    # Imports under ``if TYPE_CHECKING`` are annotations only: they never run.
    graph = grimp.build_graph("harness", "oracles", exclude_type_checking_imports=True)
    assert _cycles(graph) == []


def test_the_cycle_finder_sees_a_deliberate_cycle():
    graph = grimp.build_graph("harness", "oracles", exclude_type_checking_imports=True)
    graph.add_import(importer="harness.case.spec", imported="harness.paths")  # the case knowing a path
    assert any("harness.case.spec" in group for group in _cycles(graph))


def test_a_deliberate_layer_breach_fails_lint_imports(tmp_path):
    """compare importing a path (what compare once did for one flag): lint-imports must fail."""
    root = pathlib.Path(__file__).resolve().parents[2]
    for pkg in ("harness", "oracles"):
        shutil.copytree(root / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(root / "pyproject.toml", tmp_path / "pyproject.toml")
    values = tmp_path / "harness" / "compare" / "values.py"
    values.write_text(values.read_text() + "\nfrom harness.paths.base import Contract  # noqa: E402,F401\n")
    r = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode != 0
    assert "harness.compare.values -> harness.paths.base" in r.stdout


def _family_packages() -> list[str]:
    from harness.registry import BUILTIN, listed

    return [ep.value.split(":")[0] for ep in listed(BUILTIN)[:len(BUILTIN)]]


def _crossings(graph) -> list[tuple[str, str]]:
    fams = _family_packages()
    return [(a, b) for a in fams for b in fams
            if a != b and graph.chain_exists(importer=a, imported=b, as_packages=True)]


def test_families_import_each_other_only_through_the_core():
    graph = grimp.build_graph("harness", "oracles", exclude_type_checking_imports=True)
    assert len(_family_packages()) >= 13
    assert _crossings(graph) == []


def test_a_family_importing_another_is_seen():
    graph = grimp.build_graph("harness", "oracles", exclude_type_checking_imports=True)
    graph.add_import(importer="harness.paths.mesh.data", imported="harness.paths.pipeline.data")
    assert ("harness.paths.mesh", "harness.paths.pipeline") in _crossings(graph)
