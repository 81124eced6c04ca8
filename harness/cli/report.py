"""The terminal summary and the ``--json`` record."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from harness.artifacts.corpus import atomic_write
from harness.engine.runner import Result
from harness.observation import MISUSE_CLASS


def to_json(result: Result) -> dict[str, Any]:
    return {
        "examples": result.examples,
        "paths": {
            n: {"examples": t.examples, "run": t.run, "skipped": t.skipped, "seconds": round(t.seconds, 3),
                "ops": sorted(t.ops), "unjudged": t.unjudged}
            for n, t in result.paths.items()
        },
        "unavailable": result.unavailable,
        "divergences": [
            {k: d.to_json()[k] for k in ("path", "kind", "param", "microbatch", "max_abs", "max_rel", "ratio", "signature", "case", "detail", "flaky",
                                         "finding_class")}
            for d in result.divergences
        ],
        "expected": [d.signature for d in result.expected],
        "saved": result.saved,
    }


def write_json(result: Result, file: str) -> None:
    atomic_write(file, json.dumps(to_json(result), indent=1) + "\n")


# Misuse findings (harness.observation.MISUSE_CLASS) are listed under their own head, never among the bugs.
MISUSE_HEAD = "misuse findings: a use the stack's docs do not support, silently wrong"


def summary(result: Result, verb: str = "fuzzed", verdicts: dict[str, Counter] | None = None) -> str:
    """The per-path lines, then the divergences. ``verdicts``: each path's
    runs counted by what they mean (replay: known, fixed, ...), shown in
    place of one word for the path, so the path lines add up to the total."""
    lines = []
    wide = max([22] + [len(n) for n in list(result.paths) + list(result.unavailable)])
    for name, t in result.paths.items():
        skipped = sum(t.skipped.values())
        extra = ((f", {t.unjudged} unjudged (a wrong grad would agree)" if t.unjudged else "")
                 + (f", {len(t.ops)} OpInfo ops" if t.ops else "") + (f", {skipped} outside its contract" if skipped else ""))
        lines.append(f"  {name:<{wide}} {_path_status(result, name, t.run, verdicts)}{extra}"
                     + (f", {t.seconds:.1f}s" if t.seconds else ""))
        for reason, n in sorted(t.skipped.items(), key=lambda kv: -kv[1]):
            lines.append(f"      not in contract ({n}): {reason}")
    for name, why in result.unavailable.items():
        lines.append(f"  {name:<{wide}} NOT RUN   unavailable here: {why}")
    head = f"gradfuzz: {verb} {result.examples} example(s) on {len(result.paths)} path(s)"
    lines.insert(0, head)
    if result.expected:
        lines.append(f"known bugs, expected on this torch ({len(result.expected)}):")
        for d in _dedup(result.expected):
            lines.append(f"  - {d.path} [{d.signature}] {d.detail}")
    bugs = [d for d in result.divergences if d.finding_class != MISUSE_CLASS]
    misuse = [d for d in result.divergences if d.finding_class == MISUSE_CLASS]
    for head, divs in (("divergences", bugs), (MISUSE_HEAD, misuse)):
        if divs:
            lines.append(f"{head} ({_divergences(divs)}):")
        for d in _dedup(divs):
            lines.append(f"  - {d.path} {d.kind} [{d.signature}]{' FLAKY' if d.flaky else ''}")
            lines.append(f"      {d.detail}")
    if result.divergences:
        for f in result.saved:
            lines.append(f"  saved {f}  (reproduce: gradfuzz repro {f}; standalone: python {f[:-5]}.py)")
    elif not result.expected:  # known divergences are divergences too: the caller counts them
        lines.append("no divergence")
    return "\n".join(lines)


def _path_status(result: Result, name: str, run: int, verdicts: dict[str, Counter] | None) -> str:
    """``DIVERGES 84 run``, or with ``verdicts`` ``84 run: 18 known, 7 fixed, 59 agree``."""
    if verdicts is not None:
        c = verdicts.get(name, Counter())
        parts = [f"{n} {k.replace('_', ' ')}" for k, n in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))]
        return f"{run} run" + (f": {', '.join(parts)}" if parts else "")
    found = [d for d in result.divergences if d.path == name]
    known = [d for d in result.expected if d.path == name]
    status = ("MISUSE" if all(d.finding_class == MISUSE_CLASS for d in found) else "DIVERGES") if found else (
        "known bug" if known else "clean")
    return f"{status:<9} {run} run"


def _divergences(divs: list) -> str:
    """``9 divergences of 8 signatures``: a failing case (a find) can show several divergences."""
    sigs = len({d.signature for d in divs})
    return (f"{len(divs)} divergence{'s' if len(divs) != 1 else ''} of {sigs} signature{'s' if sigs != 1 else ''}, "
            "in the failing cases")


def _dedup(divs):
    seen, out = set(), []
    for d in divs:
        key = (d.path, d.signature, d.param)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def findings_note(folder: str, new: list[str]) -> str:
    """Where this run's findings went, said: run from any directory, they
    land under it (``.gradfuzz/found/``), and a reader must not have to guess."""
    from harness.artifacts.text import relative

    where = relative(folder).rstrip("/") + "/"
    if not new:
        return f"findings: none written this run (they go to {where})"
    return (f"findings: {len(new)} written this run in {where} (each with its .py script; "
            f"replay them all: gradfuzz replay {where})")
