"""The path registry: families in, paths out.

Every family, built-in or not, comes in as an entry point of the
``gradfuzz.paths`` group: the built-in ones are listed in ``BUILTIN`` (one
line each, in the entry-point form) and read exactly as installed ones are,
so the core names no family. An entry point names a ``Family``, a path, a
list of paths, or a callable taking the options and returning either.
``--path MODULE:ATTR`` and ``register_path`` add more. A family that does
not import here is listed as unavailable with the reason, never dropped.

``split`` names the family (``split.stock``, ``split.twin`` and
``split.fixed``); a full name picks one.
"""

from __future__ import annotations

import inspect
from importlib.metadata import EntryPoint
from typing import Any, Callable, Iterable

from harness.objects import LoadError, load_object
from harness.materialize.schedule import run_schedule
from harness.paths.base import Availability, Contract, Options, Path, Repro, UsageError, heaviness, in_child, shards_for, CHILD_SHARD_EXAMPLES
from harness.paths.family import Canary, Family, UserImpl

__all__ = ["CHILD_SHARD_EXAMPLES", "Availability", "Canary", "Contract", "Family", "Options", "Path", "Repro", "UsageError", "UserImpl",
           "all_paths", "check_options", "close_paths", "families", "heaviness", "in_child", "register_path", "resolve", "shards_for",
           "run_schedule", "split_available"]

from harness.registry import BUILTIN, GROUP, add_namespace, listed  # noqa: F401  (GROUP: for third parties' docs)

Factory = Callable[[Options], "Path | list[Path]"]
PATH_MEMBERS = ("name", "contract", "availability", "supports", "run", "repro")


def is_path(obj: Any) -> bool:
    """``isinstance(obj, Path)`` without evaluating properties.

    On Python 3.11 a runtime-checkable protocol's ``isinstance`` calls
    ``hasattr`` on every member, which runs a ``contract`` property: the
    pipeline paths' probes a process group for their layouts, so listing
    paths started a worker pool (1.1 s of ``gradfuzz paths``). Static lookup
    is what Python 3.12 does; an attribute set in ``__init__`` is found
    in the instance's ``__dict__``."""
    missing = object()
    return all(inspect.getattr_static(obj, m, missing) is not missing for m in PATH_MEMBERS)


_registered: list[Factory] = []


def register_path(factory: "Factory | Path") -> None:
    """Add a path (or a factory of paths) to every later ``resolve``."""
    _registered.append(factory if callable(factory) and not is_path(factory) else (lambda _o, p=factory: p))


class Unloadable:
    """A family that did not import here: listed, with the reason, never run."""

    def __init__(self, name: str, reason: str) -> None:
        self.name, self.reason = name, reason
        self.contract = Contract()

    def availability(self) -> Availability:
        return Availability(False, self.reason)

    def supports(self, case: Any) -> str | None:
        return self.reason

    def run(self, case: Any) -> Any:
        raise RuntimeError(f"{self.name} is unavailable: {self.reason}")

    def repro(self, case: Any) -> Repro:
        return Repro(template="none", why=f"{self.name} is unavailable: {self.reason}")


def _as_family(ep: EntryPoint) -> Family:
    """The family an entry point names; one that does not import becomes a
    family of one unavailable path named after the entry point."""
    source = f"entry point {ep.name} = {ep.value}"
    try:
        obj = ep.load()
    except Exception as e:  # an ImportError, or a module that raises on import
        why = f"{source} does not import: {type(e).__name__}: {e}"
        return Family(ep.name, paths=lambda _o: [Unloadable(f"{ep.name}.unavailable", why)])
    if isinstance(obj, Family):
        return obj
    return Family(ep.name, paths=lambda o: _expand(obj, o, source))


def families() -> list[Family]:
    """Every registered family, built-in ones first, in registration order."""
    return [_as_family(ep) for ep in listed(BUILTIN)]


def _family_paths(family: Family, options: Options) -> list[Path]:
    try:
        made = family.paths(options)
    except ImportError as e:  # the machinery is missing from this torch
        return [Unloadable(f"{family.name}.unavailable", f"{family.name} does not import: {type(e).__name__}: {e}")]
    return _expand(made, options, f"family {family.name}")


# --- the user's own setup: every flag that names code or hardware, checked here ---

PATH_FORM = "a gradfuzz Family, a path, or a callable taking the options and returning one or a list of them, as MODULE:ATTR"


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
    for impl in (u for f in families() for u in f.user_impls):
        name, flag, wants = impl.option, impl.flag, impl.wants
        spec = options.impl(name)
        if spec is None:
            continue
        load = load_object(impl.loader, "loader")
        try:
            load(spec)
        except LoadError as e:
            raise UsageError(f"{flag} {spec!r} does not load: {e}; {_fix(flag, spec, wants)} "
                             f"(or leave {flag} out to test torch's own)") from None
    _check_backend(options)


def _check_backend(options: Options) -> None:
    """``--backend nccl`` where nccl cannot start: every path it sets would be unavailable."""
    if options.backend != "nccl":
        return
    import torch
    import torch.distributed as dist

    from harness.workers import pool

    if pool.torchrun_env():
        return
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not (dist.is_available() and dist.is_nccl_available()) or gpus < options.world_size:
        have = "no nccl backend in this torch" if not (dist.is_available() and dist.is_nccl_available()) else f"{gpus} GPU(s)"
        raise UsageError(f"--backend nccl needs {options.world_size} GPU(s) (--world-size {options.world_size}) "
                         f"and torch with nccl; here: {have}. fix: leave --backend out (gloo is picked "
                         "without a GPU per rank) or lower --world-size")


def _load(spec: str) -> Any:
    try:
        return load_object(spec, "--path", require_attr=True)
    except LoadError as e:
        raise UsageError(f"{e}; {_fix('--path', spec, PATH_FORM)}") from None


def _expand(obj: Any, options: Options, source: str) -> list[Path]:
    """``obj`` (a family, a path, a list of them, or a factory of either) as
    paths; ``source`` names where it came from, for the message when it is none."""
    if isinstance(obj, Family):
        if obj.case_data is not None:
            add_namespace(obj.name, obj.case_data)
        obj = obj.paths
    try:
        made = obj if is_path(obj) else obj(options) if callable(obj) else obj
    except Exception as e:
        raise UsageError(f"{source}: calling {getattr(obj, '__qualname__', repr(obj))}(options) raised "
                         f"{type(e).__name__}: {e}; fix: it must be {PATH_FORM}") from None
    made = made if isinstance(made, list) else [made]
    for p in made:
        if not is_path(p):
            raise UsageError(f"{source}: {p!r} is not a gradfuzz path (needs name, contract, availability, supports, "
                             f"run); fix: it must be {PATH_FORM}")
    return made


def all_paths(options: Options = Options(), heads: set[str] | None = None) -> list[Path]:
    """Every path; with ``heads`` (first parts of path names), only those of
    families that may make such a path (``_may_make``)."""
    check_options(options)
    paths = [p for f in families() if _may_make(f, heads) for p in _family_paths(f, options)]
    for factory in _registered:
        paths.extend(_expand(factory, options, "register_path"))
    for spec in options.extra:
        paths.extend(_expand(_load(spec), options, f"--path {spec!r}"))
    names = [p.name for p in paths]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise UsageError(f"two paths share the name(s) {sorted(dup)}")
    return paths


def _may_make(family: Family, heads: set[str] | None) -> bool:
    """Can ``family`` make a path whose name starts with one of ``heads``?
    A family that declares no ``prefixes`` may make any."""
    return heads is None or not family.prefixes or bool(heads & set(family.prefixes))


def noise_reference() -> Path | None:
    """The path a family declares as its ``noise_reference``; None where none does."""
    names = [f.noise_reference for f in families() if f.noise_reference]
    return next((p for p in resolve(names[:1]) if p.name == names[0]), None) if names else None


def resolve(selection: Iterable[str] | str | None, options: Options = Options()) -> list[Path]:
    """Path names or family prefixes -> paths, in registry order.

    Only the families that may make a selected name are built (starting
    ``gradfuzz replay --paths split.stock`` built the pipeline paths too:
    torch.distributed.pipelining and a worker pool). A name none of them
    makes builds every family, for the message listing every path."""
    if selection is None:
        return all_paths(options)
    if isinstance(selection, str):
        selection = [s for s in selection.split(",") if s.strip()]
    wants = [s.strip() for s in selection]
    paths = all_paths(options, {w.split(".")[0] for w in wants})
    if not all(_hits(paths, w) for w in wants):
        paths = all_paths(options)
    chosen: list[Path] = []
    for want in wants:
        hits = _hits(paths, want)
        if not hits:
            known = ", ".join(p.name for p in paths)
            raise UsageError(f"unknown path {want!r}; known paths: {known} (a family name such as 'split' picks all of it)")
        chosen.extend(p for p in hits if p not in chosen)
    return chosen


def _hits(paths: list[Path], want: str) -> list[Path]:
    return [p for p in paths if p.name == want or p.name.startswith(want + ".")]


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
