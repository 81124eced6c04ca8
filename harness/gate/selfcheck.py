"""Does the harness still catch its canaries on this installation?

Run first by ``gradfuzz gate``: after a torch upgrade, a harness that lost its
teeth (a comparison that stopped comparing, a generator that stopped
producing tied weights) must fail loudly rather than pass every path.

The check is causal. A canary is *caught* only by a confirmed finding of the
kinds its injected bug produces, on a case where its base path (the canary
with the injection removed) agrees with the oracle. A canary that shows
something else, such as an exception from its own code on this torch, is
*broken*: what was caught is the canary, not the bug it carries. Both a
missed and a broken canary fail the gate.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

from harness.canaries import Canary, all_canaries, resolve_base
from harness.engine.runner import Result, fuzz_path
from harness.workers.jobs import Ended, run_jobs


@dataclass
class CanaryResult:
    name: str
    caught: bool
    examples: int | None
    seconds: float
    detail: str
    skipped: str = ""
    broken: str = ""  # why what was found is not the injected bug ("" if it is, or nothing was found)

    @property
    def state(self) -> str:
        return "skipped" if self.skipped else "caught" if self.caught else "broken" if self.broken else "missed"


def resolve(c: Canary) -> tuple[Canary, Any, Any] | CanaryResult:
    """The canary that runs here (``c``, or its fallback where ``c`` cannot),
    its path and its base; or why none runs (skipped)."""
    path = c.make()
    available = path.availability()
    if not available.ok:
        if c.fallback is not None:
            return resolve(c.fallback)
        return CanaryResult(c.name, False, None, 0.0, "", skipped=f"unavailable here: {available.reason}")
    base, skipped = resolve_base(c)
    if skipped:
        if c.fallback is not None:
            return resolve(c.fallback)
        return CanaryResult(c.name, False, None, 0.0, "", skipped=skipped)
    return c, path, base


def run_canary(c: Canary, seed: int = 0, slack: float | None = None) -> CanaryResult:
    got = resolve(c)
    if isinstance(got, CanaryResult):
        return got
    c, path, base = got
    result = Result()
    start = time.monotonic()
    try:
        fuzz_path(path, examples=c.budget, deadline=None, seed=seed, result=result, save_dir=None, relative_to=base,
                  slack=slack, until_kinds=c.expects)
    finally:
        close = getattr(path, "close", None)
        if callable(close):
            close()
    tally = result.paths[path.name]
    # Findings are confirmed (re-run) and judged against the base when found: the base agrees on each case.
    firm = [d for d in result.divergences if not d.flaky]
    own = [d for d in firm if d.kind in c.expects]
    other = [d for d in firm if d.kind not in c.expects]
    seconds = time.monotonic() - start
    if own:
        return CanaryResult(c.name, True, tally.first_hit_examples, seconds, own[0].detail)
    if other:
        d = other[0]
        why = (f"found only {d.kind} findings, not the {'/'.join(c.expects)} its injected bug makes: {d.detail}"
               f" (the canary fails for its own reasons on this torch)")
        return CanaryResult(c.name, False, tally.first_hit_examples, seconds, why, broken=why)
    detail = f"not caught in {c.budget} examples ({tally.run} in contract)"
    return CanaryResult(c.name, False, None, seconds, detail)


def selfcheck(seed: int = 0, progress=lambda s: None, slack: float | None = None,
              canaries: list[Canary] | None = None, workers: int = 1) -> list[CanaryResult]:
    """``slack`` loosens every comparison: proof that a blunted harness fails here.

    ``workers`` > 1 runs each canary in a process of its own (``gradfuzz
    selfcheck --canaries NAME --json``), that many at a time: canaries are
    independent, each draws its own seeded stream, so the results are those
    of one process, sooner. The processes find each canary by its name.
    ``slack`` runs in this process (a test hook, not a user option)."""
    todo = all_canaries() if canaries is None else canaries
    if workers > 1 and len(todo) > 1 and slack is None:
        return _in_processes(todo, seed, workers, progress)
    out = []
    for i, c in enumerate(todo, 1):
        r = run_canary(c, seed, slack)
        _say(progress, r, i, len(todo))
        out.append(r)
    return out


def _say(progress, r: CanaryResult, i: int, n: int) -> None:
    what = {"skipped": f"skipped ({r.skipped})", "caught": "caught", "broken": "BROKEN",
            "missed": "NOT CAUGHT"}[r.state]
    progress(f"[selfcheck {i}/{n}] {r.name}: {what}"
             + ("" if r.skipped else f" ({r.examples} examples, {r.seconds:.1f}s)" if r.caught
                else f" ({r.seconds:.1f}s)"))


def to_json(results: list[CanaryResult]) -> str:
    return json.dumps([asdict(r) for r in results], indent=1) + "\n"


def _in_processes(todo: list[Canary], seed: int, workers: int, progress) -> list[CanaryResult]:
    done: dict[str, CanaryResult] = {}
    with tempfile.TemporaryDirectory(prefix="gradfuzz-selfcheck-") as d:
        def out(name: str) -> str:
            return os.path.join(d, f"{name}.json")

        def ended(e: Ended) -> None:
            try:
                with open(out(e.key)) as fh:
                    (r,) = [CanaryResult(**x) for x in json.load(fh)]
            except (OSError, ValueError, TypeError):
                why = f"its self-check process exited {e.returncode} with no result; its log ends: {e.tail()}"
                r = CanaryResult(e.key, False, None, e.seconds, why, broken=why)
            done[e.key] = r
            _say(progress, r, len(done), len(todo))

        # A canary that cannot run here is said so without a process of its own
        # (eight on a CPU machine without the stacks: about 3 s of start each).
        for c in todo:
            if isinstance(r := resolve(c), CanaryResult):
                done[c.name] = r
                _say(progress, r, len(done), len(todo))
        run_jobs([(c.name, ["harness", "selfcheck", "--canaries", c.name, "--seed", str(seed), "--json", out(c.name)])
                  for c in todo if c.name not in done], workers, d, ended)
    return [done[c.name] for c in todo]
