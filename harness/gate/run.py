"""``gradfuzz gate``: the check a team runs when it upgrades torch.

Self-check, corpus replay, a fuzzing budget, then every result classified
against the ledger and the installed torch version:

- ``new``: a divergence no ledger entry explains (fails the gate)
- ``known``: a ledger bug, expected on this version (listed)
- ``fixed``: a ledger bug this version no longer shows, past its range (good news)
- ``regression``: a ledger bug back on a version past its range (fails)
- ``not_reproduced``: in range, but its cases agree here (the ledger may be too wide)
- ``unavailable``: a path that cannot run here, with why
- ``selfcheck``: a canary that was not caught (fails: the gate has lost its teeth)
- ``error``: part of the gate did not run (a harness error: the oracle or a
  worker session failed); fails, since what did not run cannot have passed
"""

from __future__ import annotations

import time
from typing import Any

import torch

from harness.gate import phases
from harness.gate.phases import Context, GateSettings
from harness.gate.rows import GateReport, Row
from harness.paths import Path


def stacks_installed() -> dict[str, str]:
    """The release of every family's training stack installed here (``Family.package``)."""
    from harness.artifacts.corpus import installed
    from harness.paths import families

    found = {f.package: installed(f.package) for f in families() if f.package}
    return {k: v for k, v in sorted(found.items()) if v}


def run_gate(paths: list[Path], **settings: Any) -> GateReport:
    """``settings``: ``GateSettings``'s fields, as keywords."""
    return run(paths, GateSettings(**settings))


def run(paths: list[Path], settings: GateSettings) -> GateReport:
    """The phases in order, each timed; then one row per bug and path."""
    start = time.monotonic()
    report = GateReport(torch=torch.__version__, packages=stacks_installed())
    lap = _Lap(report.phases)
    ctx = Context.start(settings, report)
    if settings.run_selfcheck:
        phases.selfcheck_phase(ctx, paths)
        lap("self-check")
    phases.replay_phase(ctx, paths)
    lap("replay")
    if phases.fuzzing(ctx):
        phases.fuzz_phase(ctx)
        lap("fuzz")
    phases.confirm_phase(ctx)
    phases.claim_phase(ctx)
    lap("workarounds")
    report.rows = one_row_per_bug(report.rows)
    report.seconds = time.monotonic() - start
    return report


class _Lap:
    """Records the seconds since the last lap under a phase's name."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into, self.t = into, time.monotonic()

    def __call__(self, phase: str) -> None:
        now = time.monotonic()
        self.into[phase] = self.into.get(phase, 0.0) + now - self.t
        self.t = now


def one_row_per_bug(rows: list[Row]) -> list[Row]:
    """One row per (status, ledger bug, path): the first signature seen stands
    for the others. A racy bug (a send racing an in-place add on two ranks)
    shows one signature in one run and two in the next; counted per bug, the
    same seed and budget give the same counts. New findings stay one row per
    signature: each is news of its own."""
    seen: set[tuple[str, str, str]] = set()
    out = []
    for r in rows:
        if r.bug is not None:
            key = (r.status, r.bug, r.path)
            if key in seen:
                continue
            seen.add(key)
        out.append(r)
    return out


def compare_baseline(report: dict[str, Any], baseline: dict[str, Any], selected: list[str] | None = None) -> list[str]:
    """What changed since the baseline report, path by path: what a person
    upgrading asks. ``selected``: the paths this gate ran (``--paths``); a
    baseline row of another path is not compared, since absent here means
    not run, not gone."""
    import fnmatch

    def index(r):
        out = {}
        for row in r.get("rows", []):
            key = (row["path"], row.get("bug") or row.get("signature") or row["detail"][:60])
            out[key] = row["status"]
        return out

    def ran(path: str) -> bool:  # a ledger row's path can be patterns (``split.twin, pipeline.*ZeroBubble*.stock``)
        return selected is None or any(fnmatch.fnmatchcase(n, p.strip()) for p in path.split(",") for n in selected)

    now, before = index(report), index(baseline)
    left_out = {k for k in before if k not in now and not ran(k[0])}
    before = {k: v for k, v in before.items() if k not in left_out}
    lines = [f"compared with {baseline.get('torch')} -> {report.get('torch')}:"
             + (f" ({len(left_out)} baseline row(s) of paths outside --paths not compared)" if left_out else "")]
    for path in sorted({k[0] for k in now} | {k[0] for k in before}):
        changes = []
        for key in sorted(set(now) | set(before)):
            if key[0] != path:
                continue
            a, b = before.get(key, "absent"), now.get(key, "absent")
            if a != b:
                changes.append(f"    {key[1]}: {a} -> {b}")
        lines.append(f"  {path}: " + ("no change" if not changes else f"{len(changes)} change(s)"))
        lines.extend(changes)
    return lines
