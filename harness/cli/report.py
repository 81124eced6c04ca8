"""The terminal summary and the ``--json`` record."""

from __future__ import annotations

import json
from typing import Any

from harness.artifacts.corpus import atomic_write
from harness.engine.runner import Result
from harness.observation import MISUSE_CLASS


def to_json(result: Result) -> dict[str, Any]:
    return {
        "examples": result.examples,
        "paths": {
            n: {"examples": t.examples, "run": t.run, "skipped": t.skipped, "seconds": round(t.seconds, 3),
                "ops": sorted(t.ops)}
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


def summary(result: Result, verb: str = "fuzzed") -> str:
    lines = []
    for name, t in result.paths.items():
        skipped = sum(t.skipped.values())
        found = [d for d in result.divergences if d.path == name]
        known = [d for d in result.expected if d.path == name]
        status = ("MISUSE" if all(d.finding_class == MISUSE_CLASS for d in found) else "DIVERGES") if found else (
            "known bug" if known else "clean")
        extra = (f", {len(t.ops)} OpInfo ops" if t.ops else "") + (f", {skipped} outside its contract" if skipped else "")
        lines.append(f"  {name:<22} {status:<9} {t.run} run{extra}" + (f", {t.seconds:.1f}s" if t.seconds else ""))
        for reason, n in sorted(t.skipped.items(), key=lambda kv: -kv[1]):
            lines.append(f"      not in contract ({n}): {reason}")
    for name, why in result.unavailable.items():
        lines.append(f"  {name:<22} NOT RUN   unavailable here: {why}")
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
            lines.append(f"{head} ({len(divs)}, {len({d.signature for d in divs})} distinct):")
        for d in _dedup(divs):
            lines.append(f"  - {d.path} {d.kind} [{d.signature}]{' FLAKY' if d.flaky else ''}")
            lines.append(f"      {d.detail}")
    if result.divergences:
        for f in result.saved:
            lines.append(f"  saved {f}  (reproduce: gradfuzz repro {f}; standalone: python {f[:-5]}.py)")
    elif not result.expected:  # known divergences are divergences too: the caller counts them
        lines.append("no divergence")
    return "\n".join(lines)


def _dedup(divs):
    seen, out = set(), []
    for d in divs:
        key = (d.path, d.signature, d.param)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out
