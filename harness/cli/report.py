"""The terminal summary and the ``--json`` record."""

from __future__ import annotations

import json
from typing import Any

from harness.artifacts.corpus import atomic_write
from harness.engine.runner import Result


def to_json(result: Result) -> dict[str, Any]:
    return {
        "examples": result.examples,
        "paths": {
            n: {"examples": t.examples, "run": t.run, "skipped": t.skipped, "seconds": round(t.seconds, 3)}
            for n, t in result.paths.items()
        },
        "unavailable": result.unavailable,
        "divergences": [
            {k: d.to_json()[k] for k in ("path", "kind", "param", "microbatch", "max_abs", "max_rel", "ratio", "signature", "case", "detail", "flaky")}
            for d in result.divergences
        ],
        "expected": [d.signature for d in result.expected],
        "saved": result.saved,
    }


def write_json(result: Result, file: str) -> None:
    atomic_write(file, json.dumps(to_json(result), indent=1) + "\n")


def summary(result: Result, verb: str = "fuzzed") -> str:
    lines = []
    for name, t in result.paths.items():
        skipped = sum(t.skipped.values())
        found = [d for d in result.divergences if d.path == name]
        known = [d for d in result.expected if d.path == name]
        status = "DIVERGES" if found else "known bug" if known else "clean"
        extra = f", {skipped} outside its contract" if skipped else ""
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
    if result.divergences:
        lines.append(f"divergences ({len(result.divergences)}, {len({d.signature for d in result.divergences})} distinct):")
        for d in _dedup(result.divergences):
            lines.append(f"  - {d.path} {d.kind} [{d.signature}]{' FLAKY' if d.flaky else ''}")
            lines.append(f"      {d.detail}")
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
