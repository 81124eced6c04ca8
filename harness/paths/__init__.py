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
from harness.materialize.schedule import run_schedule
from harness.paths.base import Availability, Contract, Options, Path, Repro, UsageError
from harness.paths.eager import EagerAccumulate
from harness.paths.split import STOCK, SplitPath

__all__ = ["Availability", "Contract", "Options", "Path", "Repro", "UsageError", "all_paths", "check_options", "close_paths",
           "register_path", "resolve", "run_schedule", "split_available"]


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


# --- the user's own setup: every flag that names code or hardware, checked here ---

# The flags that point a built-in path at the user's own implementation:
# (Options field, flag, the loader that imports and checks it, what it must name).
USER_IMPLS: tuple[tuple[str, str, str, str], ...] = (
    ("split_impl", "--split-impl", "harness.paths.split:load_impl",
     "MODULE[:ATTR] with stage_backward_input and stage_backward_weight"),
    ("graphed_impl", "--graphed-impl", "harness.paths.graphed:load_impl",
     "MODULE:ATTR, a make_graphed_callables-like callable"),
    ("dtensor_impl", "--dtensor-impl", "harness.paths.dtensor.rank:load_impl",
     "MODULE[:ATTR] with install(params, mesh)"),
)
PATH_FORM = "a gradfuzz path, or a callable taking the options and returning one or a list of them, as MODULE:ATTR"


def _fix(flag: str, spec: str, wants: str) -> str:
    """The fix for a ``flag`` whose ``spec`` did not load: make the module
    importable when it did not import, else name the right object."""
    import sys

    module = spec.partition(":")[0]
    if module not in sys.modules:
        return (f"fix: install the package that provides {module!r} or put its folder on PYTHONPATH "
                f"(python -c 'import {module}' shows the error), so that {flag} names {wants}")
    return f"fix: make {flag} name {wants}"


def check_options(options: Options) -> None:
    """Every user flag honoured, or a UsageError (exit 2) naming the flag,
    what went wrong and the fix. A path the user pointed at their own code
    must not turn "unavailable" when that code does not import: the gate
    would PASS with nothing of theirs tested."""
    for name, flag, loader, wants in USER_IMPLS:
        spec = getattr(options, name)
        if spec is None:
            continue
        load = load_object(loader, "loader")
        try:
            load(spec)
        except LoadError as e:
            raise UsageError(f"{flag} {spec!r} does not load: {e}; {_fix(flag, spec, wants)} "
                             f"(or leave {flag} out to test torch's own)") from None
    _check_backend(options)


def _check_backend(options: Options) -> None:
    """``--dtensor-backend nccl`` where nccl cannot start: every path it sets would be unavailable."""
    if options.dtensor_backend != "nccl":
        return
    import torch
    import torch.distributed as dist

    from harness.workers import pool

    if pool.torchrun_env():
        return
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not (dist.is_available() and dist.is_nccl_available()) or gpus < options.world_size:
        have = "no nccl backend in this torch" if not (dist.is_available() and dist.is_nccl_available()) else f"{gpus} GPU(s)"
        raise UsageError(f"--dtensor-backend nccl needs {options.world_size} GPU(s) (--world-size {options.world_size}) "
                         f"and torch with nccl; here: {have}. fix: leave --dtensor-backend out (gloo is picked "
                         "without a GPU per rank) or lower --world-size")


def _load(spec: str) -> Any:
    try:
        return load_object(spec, "--path", require_attr=True)
    except LoadError as e:
        raise UsageError(f"{e}; {_fix('--path', spec, PATH_FORM)}") from None


def _expand(obj: Any, options: Options, source: str) -> list[Path]:
    """``obj`` (a path, a list of them, or a factory of either) as paths;
    ``source`` names where it came from, for the message when it is none."""
    try:
        made = obj if isinstance(obj, Path) else obj(options) if callable(obj) else obj
    except Exception as e:
        raise UsageError(f"{source}: calling {getattr(obj, '__qualname__', repr(obj))}(options) raised "
                         f"{type(e).__name__}: {e}; fix: it must be {PATH_FORM}") from None
    made = made if isinstance(made, list) else [made]
    for p in made:
        if not isinstance(p, Path):
            raise UsageError(f"{source}: {p!r} is not a gradfuzz path (needs name, contract, availability, supports, "
                             f"run); fix: it must be {PATH_FORM}")
    return made


def all_paths(options: Options = Options()) -> list[Path]:
    check_options(options)
    paths = _builtin(options)
    for ep in entry_points(group="gradfuzz.paths"):
        paths.extend(_expand(ep.load(), options, f"entry point {ep.name} = {ep.value}"))
    for factory in _registered:
        paths.extend(_expand(factory, options, "register_path"))
    for spec in options.extra:
        paths.extend(_expand(_load(spec), options, f"--path {spec!r}"))
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
