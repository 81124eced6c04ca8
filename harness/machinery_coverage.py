"""Line and arc coverage of the machinery under test, and nothing else.

``gradfuzz fuzz --coverage`` asks how much of the code a family tests
(``torch/utils/checkpoint.py`` for checkpoint, AOTAutograd for compile, ...)
the drawn cases reach. A whole-process coverage tool would trace torch,
Hypothesis and the harness too; here a ``sys.settrace`` tracer returns no
local tracer for any frame outside the family's files, so only their lines
pay for a line event. Every other Python call still pays one call event
(Python 3.11 has no ``sys.monitoring``), which is the overhead measured in
``benchmarks/coverage_guided.py``.

It sits near the bottom of the layers and imports only the registry, so the
engine and a rank process can both use it.

Each family declares its machinery (``Family.machinery``: module names, a
package meaning every ``.py`` file under it), read from the registered
families when first asked. Modules that are not installed here (deepspeed)
are left out of the count.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from types import CodeType, FrameType
from typing import Any, Callable, Iterable, Iterator

from harness import registry


def module_files(module: str) -> list[str]:
    """The ``.py`` files of ``module`` (every one under it, for a package),
    absolute and as the interpreter names them in ``co_filename``; [] when
    it is not installed here. Found from the top-level package's location,
    so nothing is imported (a rank or worker process asks this too)."""
    top, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError, AttributeError):
        return []
    if spec is None or spec.origin is None:
        return []
    if not spec.submodule_search_locations:
        return [spec.origin] if not rest and spec.origin.endswith(".py") else []
    out: list[str] = []
    for root in spec.submodule_search_locations:
        base = os.path.join(root, *rest.split(".")) if rest else root
        if os.path.isdir(base):
            for d, dirs, files in os.walk(base):
                dirs.sort()
                out.extend(os.path.join(d, f) for f in sorted(files) if f.endswith(".py"))
        elif os.path.isfile(base + ".py"):
            out.append(base + ".py")
    return out


def _codes(code: CodeType) -> Iterator[CodeType]:
    yield code
    for c in code.co_consts:
        if isinstance(c, CodeType):
            yield from _codes(c)


@lru_cache(maxsize=None)
def executable_lines(file: str) -> frozenset[int]:
    """The lines of ``file`` a case can reach: those holding code of a
    function or class body (the module's top level runs once, at import,
    before any case). A function's ``def`` line is left out: entering a
    function emits a call event, not a line event, so it could never count."""
    try:
        with open(file, "rb") as fh:
            module = compile(fh.read(), file, "exec", dont_inherit=True)
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    lines: set[int] = set()
    for code in _codes(module):
        if code is module:
            continue
        lines.update(ln for _s, _e, ln in code.co_lines() if ln is not None and ln != code.co_firstlineno)
    return frozenset(lines)


@dataclass
class Machinery:
    """One family's files and their reachable lines."""

    family: str
    modules: tuple[str, ...]
    files: dict[str, frozenset[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, family: str, modules: Iterable[str] | None = None) -> "Machinery":
        mods = tuple(modules if modules is not None else registry.declared("machinery").get(family, ()))
        files = {f: executable_lines(f) for m in mods for f in module_files(m)}
        return cls(family, mods, {f: ls for f, ls in files.items() if ls})

    @property
    def total(self) -> int:
        return sum(len(ls) for ls in self.files.values())


Arc = tuple[str, int, int]  # (file, from line, to line); a negative line is the code's entry or exit
Line = tuple[str, int]


class Tracer:
    """A ``sys.settrace`` tracer that records lines and arcs of ``files`` only.

    ``with tracer:`` traces this thread and threads started inside; the
    previous trace function (a debugger, coverage.py under the tests) is
    put back on exit. Lines and arcs accumulate in ``lines``/``arcs`` until
    ``take()``.
    """

    def __init__(self, files: Iterable[str]) -> None:
        self.files = frozenset(files)
        self._wanted: dict[str, bool] = {}
        self.lines: set[Line] = set()
        self.arcs: set[Arc] = set()
        self._saved: list[tuple[Any, Any]] = []

    def _want(self, filename: str) -> bool:
        hit = self._wanted.get(filename)
        if hit is None:
            hit = self._wanted[filename] = filename in self.files or (
                os.path.isabs(filename) and os.path.realpath(filename) in self.files)
        return hit

    def _call(self, frame: FrameType, event: str, arg: Any) -> Callable | None:
        """The global tracer: one dict lookup per Python call; a local tracer only for machinery frames."""
        code = frame.f_code
        filename = code.co_filename
        hit = self._wanted.get(filename)
        if hit is None:
            hit = self._want(filename)
        if not hit:
            return None
        lines, arcs = self.lines, self.arcs
        last = -code.co_firstlineno

        def local(frame: FrameType, event: str, arg: Any) -> Callable:
            nonlocal last
            if event == "line":
                ln = frame.f_lineno
                lines.add((filename, ln))
                arcs.add((filename, last, ln))
                last = ln
            elif event == "return":
                arcs.add((filename, last, -code.co_firstlineno))
            return local

        return local

    def __enter__(self) -> "Tracer":
        self._saved.append((sys.gettrace(), threading.gettrace() if hasattr(threading, "gettrace") else None))
        threading.settrace(self._call)
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc: object) -> None:
        previous, previous_threads = self._saved.pop()
        sys.settrace(previous)
        threading.settrace(previous_threads)  # type: ignore[arg-type]

    def take(self) -> tuple[set[Line], set[Arc]]:
        """What was recorded since the last ``take``; the tracer starts empty again."""
        lines, arcs = self.lines, self.arcs
        self.lines, self.arcs = set(), set()
        return lines, arcs


@dataclass
class FamilyCoverage:
    """What one family's cases reached so far in this process (or, combined, in a session)."""

    family: str
    total: int  # reachable lines in its files
    files: int
    lines: set[Line] = field(default_factory=set)
    arcs: set[Arc] = field(default_factory=set)
    examples: int = 0  # traced path runs

    def to_json(self) -> dict[str, Any]:
        """Lines per file, sorted: what ``combine`` unions across processes."""
        per_file: dict[str, list[int]] = {}
        for f, ln in self.lines:
            per_file.setdefault(f, []).append(ln)
        return {"total": self.total, "files": self.files, "examples": self.examples, "arcs": len(self.arcs),
                "lines": {f: sorted(ls) for f, ls in sorted(per_file.items())},
                "arc_list": sorted(self.arcs)}

    @classmethod
    def from_json(cls, family: str, d: dict[str, Any]) -> "FamilyCoverage":
        fc = cls(family, d["total"], d["files"], examples=d.get("examples", 0))
        fc.lines = {(f, ln) for f, ls in d.get("lines", {}).items() for ln in ls}
        fc.arcs = {(a[0], a[1], a[2]) for a in d.get("arc_list", [])}
        return fc

    def merge(self, other: "FamilyCoverage") -> None:
        self.lines |= other.lines
        self.arcs |= other.arcs
        self.examples += other.examples
        self.total = max(self.total, other.total)
        self.files = max(self.files, other.files)

    def line(self) -> str:
        """The summary's line for this family."""
        pct = f" ({100.0 * len(self.lines) / self.total:.1f}%)" if self.total else ""
        return (f"machinery coverage [{self.family}]: {len(self.lines)} lines of {self.total} in {self.files} files"
                f"{pct}, {len(self.arcs)} arcs, {self.examples} traced run(s)")


class Meter:
    """Per-family coverage of path runs, with the new lines of each example.

    ``measure(family, fn)`` runs ``fn`` traced against that family's files;
    ``example_done()`` ends an example and returns how many lines (of any
    family) it reached that no earlier example had: the guidance score.
    """

    def __init__(self, machinery: Callable[[str], Machinery] | None = None) -> None:
        self._machinery = machinery or Machinery.of
        self.families: dict[str, FamilyCoverage] = {}
        self._tracers: dict[str, Tracer] = {}
        self.new_lines = 0
        self._case: set[Line] = set()
        self._version = 0  # bumped when anything new is reached: ``to_json`` is asked for at every progress beat
        self._json: tuple[int, dict[str, Any]] | None = None

    def tracer(self, family: str) -> Tracer:
        if family not in self._tracers:
            m = self._machinery(family)
            self._tracers[family] = Tracer(m.files)
            self.families[family] = FamilyCoverage(family, m.total, len(m.files))
        return self._tracers[family]

    def measure(self, family: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` traced; what a worker process traced for it (``attach``) is counted too."""
        tracer = self.tracer(family)
        fc = self.families[family]
        result = None
        _deposited.clear()  # a rank's lines from requests outside any measured run (a probe) are not this run's
        try:
            with tracer:
                result = fn()
            return result
        finally:
            lines, arcs = tracer.take()
            children = [_detach(result), *_deposited]
            _deposited.clear()
            for child in children:
                if child is not None:
                    lines |= {ln for ln in child[0] if ln[0] in tracer.files}
                    arcs |= {a for a in child[1] if a[0] in tracer.files}
            fresh = lines - fc.lines
            self.new_lines += len(fresh)
            self._case |= lines
            if fresh or not arcs <= fc.arcs:
                fc.lines |= lines
                fc.arcs |= arcs
                self._version += 1
            fc.examples += 1

    def example_done(self) -> tuple[int, int]:
        """(new lines, lines) of the example just run; both reset."""
        out = (self.new_lines, len(self._case))
        self.new_lines = 0
        self._case = set()
        return out

    def to_json(self) -> dict[str, Any]:
        """Every family's lines and arcs, as ``combine`` reads them (cached until something new is reached)."""
        if self._json is None or self._json[0] != self._version:
            self._json = (self._version, {f: fc.to_json() for f, fc in sorted(self.families.items())})
        out = self._json[1]
        for f, fc in self.families.items():  # the run counts move every example; lines and arcs do not
            out[f]["examples"] = fc.examples
        return out


def combine(snapshots: Iterable[dict[str, Any]]) -> dict[str, FamilyCoverage]:
    """Several processes' ``Meter.to_json()`` -> one coverage per family (lines and arcs unioned)."""
    out: dict[str, FamilyCoverage] = {}
    for snap in snapshots:
        for family, d in (snap or {}).items():
            fc = FamilyCoverage.from_json(family, d)
            if family in out:
                out[family].merge(fc)
            else:
                out[family] = fc
    return out


# --- worker processes ------------------------------------------------------
#
# Some paths run their case in a child process (``harness.workers.isolation``:
# the compile flavours, the graphed paths) or on the ranks of a worker pool
# (``harness.workers.pool``: pipeline, dtensor, ddp, fsdp2, mesh, ...). A
# child started while this variable is set traces every family's machinery
# around each case (each request, on a rank) and hands its lines back under
# ``EXTRA_KEY``: in ``Observation.extra``, or in the rank's reply, which the
# pool takes out at once and ``deposit``s here. The parent's ``Meter`` takes
# them (so nothing downstream sees them) and keeps those in the family's own
# files. Ranks under torchrun (``TorchrunGroup``) are not traced.

ENV = "GRADFUZZ_MACHINERY_COVERAGE"
EXTRA_KEY = "machinery_coverage"


def request_in_children(on: bool = True) -> None:
    """Ask worker processes started from now on to trace (the session calls it when ``--coverage`` is on)."""
    if on:
        os.environ[ENV] = "1"
    else:
        os.environ.pop(ENV, None)


# How much longer a traced rank may take before its request counts as hung: tracing
# slows a rank's Python several times over, and a false "timeout" finding (a dtensor
# case past its 10 s on a loaded 2-core host) is worse than a late true one.
SLOWDOWN = 4.0


def slowdown() -> float:
    """The factor on a worker pool's request timeout: ``SLOWDOWN`` while ranks trace, else 1."""
    return SLOWDOWN if os.environ.get(ENV) else 1.0


_child: list[Tracer | None] = []


def child_tracer() -> Tracer | None:
    """This worker process's tracer over every family's machinery, when its parent asked for one."""
    if not _child:
        if os.environ.get(ENV):  # an untraced process loads no family for it
            declared = registry.declared("machinery")
            _child.append(Tracer(f for mods in declared.values() for m in mods for f in module_files(m)))
        else:
            _child.append(None)
    return _child[0]


def attach(extra: dict[str, Any], tracer: Tracer) -> None:
    """Put what ``tracer`` recorded for one case into an observation's ``extra`` (picklable, sorted)."""
    lines, arcs = tracer.take()
    extra[EXTRA_KEY] = (sorted(lines), sorted(arcs))


def _detach(result: Any) -> tuple[list[Line], list[Arc]] | None:
    extra = getattr(result, "extra", None)
    if isinstance(extra, dict) and EXTRA_KEY in extra:
        return _pop(extra)
    return None


def _pop(d: dict[str, Any]) -> tuple[list[Line], list[Arc]]:
    lines, arcs = d.pop(EXTRA_KEY)
    return [tuple(x) for x in lines], [tuple(x) for x in arcs]  # type: ignore[misc]


_deposited: list[tuple[list[Line], list[Arc]]] = []  # ranks' lines since the measured run began


def deposit(reply: dict[str, Any]) -> None:
    """Take a rank's lines out of its reply (the family's code never sees
    them) and keep them for the ``Meter`` measuring the current run."""
    if EXTRA_KEY in reply:
        _deposited.append(_pop(reply))
        del _deposited[:-256]  # bounded when nothing measures (a probe, a run without --coverage's meter)
