"""The path registry: names to paths, with families and third-party paths.

``split`` names the family (``split.stock``, ``split.twin`` and ``split.fixed``); a full
name picks one. Third parties add paths through the ``gradfuzz.paths``
entry-point group or ``--path MODULE:ATTR``; the object found is a path, or
a callable taking the options and returning a path or a list of them.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any, Callable, Iterable

from harness.objects import LoadError, load_object
from harness.build.schedule import run_schedule
from harness.paths.base import Availability, Contract, Options, Path, Repro, UsageError
from harness.paths.eager import EagerAccumulate
from harness.paths.split import STOCK, SplitPath

__all__ = ["Availability", "Contract", "Options", "Path", "Repro", "UsageError", "all_paths", "close_paths", "register_path",
           "resolve", "run_schedule", "split_available"]


Factory = Callable[[Options], "Path | list[Path]"]
_registered: list[Factory] = []


def register_path(factory: "Factory | Path") -> None:
    """Add a path (or a factory of paths) to every later ``resolve``."""
    _registered.append(factory if callable(factory) and not isinstance(factory, Path) else (lambda _o, p=factory: p))


def _builtin(options: Options) -> list[Path]:
    paths: list[Path] = [
        EagerAccumulate(),
        SplitPath("split.stock", options.split_impl or STOCK, stock_contract=True),
        SplitPath("split.twin", options.split_impl or STOCK, stock_contract=True, twin=True),
        SplitPath("split.fixed", "oracles.split_fixed", stock_contract=False),
    ]
    for factory in _optional_builtins():
        made = factory(options)
        paths.extend(made if isinstance(made, list) else [made])
    return paths


def _optional_builtins() -> list[Factory]:
    """Path modules added by later work; each is one module under harness.paths."""
    found = []
    for mod in ("harness.paths.dtensor.path", "harness.paths.graphed", "harness.paths.pipeline.path", "harness.paths.compile",
                "harness.paths.checkpoint", "harness.paths.parallel.path"):
        try:
            found.append(importlib.import_module(mod).paths)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
    return found


def _load(spec: str) -> Any:
    try:
        return load_object(spec, "--path", require_attr=True)
    except LoadError as e:
        raise UsageError(str(e)) from None


def _expand(obj: Any, options: Options) -> list[Path]:
    made = obj if isinstance(obj, Path) else obj(options) if callable(obj) else obj
    made = made if isinstance(made, list) else [made]
    for p in made:
        if not isinstance(p, Path):
            raise UsageError(f"{p!r} is not a gradfuzz path (needs name, contract, availability, supports, run)")
    return made


def all_paths(options: Options = Options()) -> list[Path]:
    paths = _builtin(options)
    for ep in entry_points(group="gradfuzz.paths"):
        paths.extend(_expand(ep.load(), options))
    for factory in _registered:
        paths.extend(_expand(factory, options))
    for spec in options.extra:
        paths.extend(_expand(_load(spec), options))
    names = [p.name for p in paths]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise UsageError(f"two paths share the name(s) {sorted(dup)}")
    return paths


def resolve(selection: Iterable[str] | str | None, options: Options = Options()) -> list[Path]:
    """Path names or family prefixes -> paths, in registry order."""
    paths = all_paths(options)
    if selection is None:
        return paths
    if isinstance(selection, str):
        selection = [s for s in selection.split(",") if s.strip()]
    chosen: list[Path] = []
    for want in (s.strip() for s in selection):
        hits = [p for p in paths if p.name == want or p.name.startswith(want + ".")]
        if not hits:
            known = ", ".join(p.name for p in paths)
            raise UsageError(f"unknown path {want!r}; known paths: {known} (a family name such as 'split' picks all of it)")
        chosen.extend(p for p in hits if p not in chosen)
    return chosen


def split_available(paths: list[Path]) -> tuple[list[Path], dict[str, str]]:
    """The paths that can run here, and why each other one cannot."""
    live, unavailable = [], {}
    for p in paths:
        a = p.availability()
        if a.ok:
            live.append(p)
        else:
            unavailable[p.name] = a.reason
    return live, unavailable


def close_paths(paths: list[Path]) -> None:
    """Paths that own processes or devices release them here (optional ``close``)."""
    for p in paths:
        close = getattr(p, "close", None)
        if callable(close):
            close()
