"""The one check step: a case against the oracle on some paths.

Fuzzing (``harness.engine.target``), replay (``replay_entries``: ``gradfuzz
replay``, the gate, the pytest plugin's replay items) and the public
``harness.check`` all go through ``CaseCheck``: the eager oracle and the
case's tolerance are computed once, on first need, and shared by every path
the case runs on; a path whose contract does not take the case is not run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from harness.case import opinfo
from harness.case.spec import Case
from harness.compare.values import Tolerance, blind_to, compare
from harness.engine.coverage import Meter, machinery_family
from harness.observation import Divergence, Observation, classify
from harness.artifacts import corpus
from harness.paths import Path
from oracles.eager import OracleError, observe

# A corpus case marked flaky (an order-dependent bug) gets this many tries
# before replay calls it agreeing; each meets another heap (``_ballast``).
FLAKY_TRIES = 16


@dataclass
class Profile:
    """Where a target's CPU time went, per phase (seconds), for ``gradfuzz bench``."""

    cases: int = 0
    body: float = 0.0  # inside the test function, everything below included
    oracle: float = 0.0
    tolerance: float = 0.0
    compare: float = 0.0
    paths: dict[str, float] = field(default_factory=dict)
    path_runs: dict[str, int] = field(default_factory=dict)


# The eager runs a check makes in this process (the oracle, the float32 and
# lower-precision noise runs), one at a time: the gate checks the paths that
# run in children side by side from threads, and each oracle is then still
# computed as in a run of one thread.
_HERE = threading.RLock()


class CaseCheck:
    """One case; the oracle and the tolerance are shared by every path run on it.

    ``slack`` loosens every comparison, exact mode included: it exists to
    prove that selfcheck fails when detection is broken.
    """

    def __init__(self, case: Case, *, slack: float | None = None, lazy: bool = False,
                 profile: Profile | None = None, oracle: Observation | None = None,
                 tol: Tolerance | None = None, meter: "Meter | None" = None) -> None:
        self.case = case
        self.meter = meter  # --coverage: each path run traced against its family's machinery files
        self.slack = slack
        self.lazy = lazy
        self.profile = profile
        self._oracle = oracle
        self._tol = tol
        self._bases: dict[str, bool] = {}
        self.seen: dict[str, Observation] = {}  # each path's last observation (``gradfuzz versions`` reads refusals)
        self._low: dict[tuple[str, bool], Observation | None] = {}  # eager in a lower type, by its name (jittered)

    @property
    def oracle(self) -> Observation:
        with _HERE:
            if self._oracle is None:
                t0 = time.process_time()
                self._oracle = observe(self.case)
                if self.profile is not None:
                    self.profile.oracle += time.process_time() - t0
            return self._oracle

    @property
    def tol(self) -> Tolerance:
        with _HERE:
            if self._tol is None:
                t0 = time.process_time()
                self._tol = Tolerance.for_case(self.case, slack=self.slack, lazy=self.lazy).with_noise(
                    self.case, self.oracle, self._eager32, self._eager_low)
                if self.profile is not None:
                    self.profile.tolerance += time.process_time() - t0
            return self._tol

    def _eager32(self) -> Observation | None:
        """Eager autograd in the case's own dtype: the float32 noise the
        tolerance caps a path's difference by (None: eager cannot run it)."""
        eager = _eager_path()
        if eager is None or eager.supports(self.case) is not None:
            return None
        if eager.name in self.seen:
            return self.seen[eager.name]
        t0 = time.process_time()
        try:
            return eager.run(self.case)
        finally:
            if self.profile is not None:
                self.profile.tolerance += time.process_time() - t0

    def _eager_low(self, precision: str, jitter: bool = False) -> Observation | None:
        """Eager computing in ``precision``: the rounding a path that
        computes in it may show (None: some op of the case has no kernel
        in that type). ``jitter``: on inputs moved a step of that type."""
        key = (precision, jitter)
        if key in self._low:
            return self._low[key]
        t0 = time.process_time()
        try:
            self._low[key] = observe(self.case, low=getattr(torch, precision), jitter=jitter)
        except OracleError:
            self._low[key] = None
        finally:
            if self.profile is not None:
                self.profile.tolerance += time.process_time() - t0
        return self._low[key]

    def unjudged(self, obs: Observation | None = None) -> bool:
        """Whether a wrong parameter grad would agree (``blind_to``: halved,
        zeroed, flipped or a microbatch dropped): a pass on this case says
        nothing about that grad, so it is counted, never called a pass.
        ``obs``: a path's observation, judged in the type it computed in."""
        if obs is not None and obs.extra.get("unjudged"):  # the path saw no grad to judge (fp16 overflow)
            return True
        tol = self.tol if obs is None else self.tol.lowered(obs.precision, self.case, obs.rounded)
        return bool(blind_to(tol, self.oracle, self.case.schedule.microbatches, self.case.dtype))

    def observe(self, path: Path) -> Observation:
        """What ``path`` saw on this case (which must be in its contract)."""
        t0 = time.process_time()
        if self.meter is not None:
            obs = self.meter.measure(machinery_family(path.name), lambda: path.run(self.case))
        else:
            obs = path.run(self.case)
        self.seen[path.name] = obs
        if self.profile is not None:
            self.profile.paths[path.name] = self.profile.paths.get(path.name, 0.0) + (time.process_time() - t0)
            self.profile.path_runs[path.name] = self.profile.path_runs.get(path.name, 0) + 1
        return obs

    def run(self, path: Path) -> list[Divergence]:
        """The divergences of ``path`` on this case (which must be in its contract)."""
        oracle, tol = self.oracle, self.tol
        obs = self.observe(path)
        t1 = time.process_time()
        divs = compare(self.case, oracle, obs, retained_grads=path.contract.retained_grads, tol=tol,
                       blind=path.contract.blind_to())
        if self.profile is not None:
            self.profile.compare += time.process_time() - t1
        base = path.contract.judged_against
        if divs and base and self._base_diverges(base):
            return []
        return classify(path, self.case, divs)

    def _base_diverges(self, name: str) -> bool:
        """Does ``name``, the path another is built on, diverge on this case too? Once per case."""
        if name not in self._bases:
            base = _base_path(name)
            self._bases[name] = base is not None and base.supports(self.case) is None and bool(self.run(base))
        return self._bases[name]

    def each(self, paths: Iterable[Path]) -> Iterator[tuple[Path, str | None, list[Divergence]]]:
        """``(path, why not run or None, divergences)`` for each path in turn."""
        here = opinfo.unavailable(self.case.nodes)
        for p in paths:
            reason = here or p.supports(self.case)
            yield p, reason, ([] if reason is not None else self.run(p))


_bases: dict[str, Path | None] = {}


def _base_path(name: str) -> Path | None:
    if name not in _bases:
        from harness.paths import resolve

        found = [p for p in resolve(name) if p.name == name]
        _bases[name] = found[0] if found else None
    return _bases[name]


def check(case: Case, path: Path, oracle: Observation | None = None, tol: Tolerance | None = None,
          slack: float | None = None) -> list[Divergence]:
    """Run one case on one path; the case must be inside the path's contract."""
    return CaseCheck(case, slack=slack, oracle=oracle, tol=tol).run(path)


def _ballast(t: int) -> list[object]:
    """Objects held through flaky try ``t``. The order-dependent bugs iterate
    sets of autograd nodes, hashed by address; a retry in the same process
    reuses the freed addresses and meets the same order, so retries alone
    missed (3 of 12 fresh processes, 9 tries each, on the split case). Small
    objects of every pymalloc size class, a different count each try, move
    the nodes' addresses (0 of 12 missed)."""
    return [(j, j, -j) for j in range(t)] + [bytes(s) for s in range(0, 200, 8) for _ in range(t % 4)]


@dataclass
class Replayed:
    entry: corpus.Entry
    path: Path
    skipped: str | None  # why the path's contract does not take the case
    divergences: list[Divergence]


def replay_entries(entries: Iterable[corpus.Entry], paths: list[Path],
                   slack: float | None = None) -> Iterator[Replayed]:
    """Every corpus entry on every path, in that order; divergences carry their case.

    An entry marked ``flaky`` that agrees is tried again (``FLAKY_TRIES``):
    an order-dependent bug must not pass a replay by luck.
    """
    for entry in entries:
        cc = CaseCheck(entry.case, slack=slack)
        for path, reason, divs in cc.each(paths):
            for t in range(1, FLAKY_TRIES + 1 if reason is None and entry.meta.get("flaky") and not divs else 0):
                held = _ballast(t)
                divs = cc.run(path)
                del held
                if divs:
                    break
            for d in divs:
                d.case = entry.case.to_json()
            yield Replayed(entry, path, reason, divs)


_EAGER: list[Path | None] = []


def _eager_path() -> Path | None:
    if not _EAGER:
        from harness.paths import noise_reference

        _EAGER.append(noise_reference())
    return _EAGER[0]
