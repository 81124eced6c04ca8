"""Corpus replay on N processes (``gate -n N``): the same results as one process.

The unit of work is a group of paths that share their setup (a family, a
pipeline schedule, the compile flavours of one backend: pools and compile
caches are built once per group). N children (``python -m
harness.engine.replay_pool SPEC``) each take the next unclaimed group,
heaviest first (``harness.paths.heaviness``), replay every corpus case on
it, close its paths, and take the next, so a process start (torch, the
corpus, the families: about 3 s here) is paid N times, not once per group
(33 groups on 2.13 CPU). A group is claimed by creating its claim file
exclusively, so no group runs twice. Each group's results go to its own
file, one JSON line per (case, path) as they come, so the parent shows
progress and keeps what a dead child did finish. The parent hands the
results back in the one-process order (cases, then paths in registry
order), so the gate classifies them exactly as it would in one process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from typing import Any, Callable

from harness.engine.check import Replayed, replay_entries
from harness.observation import Divergence
from harness.artifacts import corpus
from harness.paths import Options, Path, close_paths, heaviness, resolve
from harness.workers.isolation import OVERLAP_ENV
from harness.workers.jobs import Ended, run_jobs

def job_key(name: str) -> str:
    """Paths that share setup: ``pipeline.GPipe.stock`` and ``.fixed`` -> ``pipeline.GPipe``."""
    return name.rsplit(".", 1)[0]


SPLIT_AT = 100  # heaviness (``harness.paths.heaviness``) of the groups whose cases are shared out
CASES_PER_PART = 8  # at least this many cases per part: each part starts the group's paths anew


def units(live: list[Path], n_files: int, workers: int) -> dict[str, tuple[list[str], list[int]]]:
    """The claimable units of work, heaviest first: ``key -> (path names, case
    indices)``. A group is one unit, except a heavy one (the compile
    flavours, the graphed paths) on more than two processes: its cases are
    dealt out to several parts, or the replay waits on one process running
    that group while the others are idle (measured in docs/benchmarks.md:
    the last sixth of the pairs ran on 2 processes). Results do not depend on the
    split: every (case, path) is replayed on its own and handed back in the
    one-process order."""
    groups: dict[str, list[Path]] = {}
    for p in sorted(live, key=lambda p: -heaviness(p)):  # heaviest groups claimed first (a stable sort)
        groups.setdefault(job_key(p.name), []).append(p)
    out: dict[str, tuple[list[str], list[int]]] = {}
    for key, ps in groups.items():
        heavy = workers > 2 and max(heaviness(p) for p in ps) >= SPLIT_AT
        parts = max(1, min(workers, n_files // CASES_PER_PART)) if heavy else 1
        for k in range(parts):
            out[key if parts == 1 else f"{key}#{k}"] = ([p.name for p in ps], list(range(k, n_files, parts)))
    return out


def tick_line(done: int, total: int, running: int, waiting: int, units: int) -> str:
    """"D of N", not "D/N": the progress line paces a D/N count, and these
    pairs differ a thousandfold in cost (a compile flavour's against an eager
    one), the heavy units first, so a pace read 07:48 left with 58 s to go."""
    return (f"[phase] replay: {done} of {total} (case, path) pairs run on {running} processes, "
            f"{waiting} of {units} units of work not started")


def replay_on_workers(entries: list[corpus.Entry], live: list[Path], workers: int, options: Options,
                      progress: Callable[[str], None] = lambda s: None) -> list[Replayed]:
    files = [os.path.abspath(e.file) for e in entries]
    groups = units(live, len(files), workers)
    # Counted are the pairs that run: one outside its path's contract ends at
    # once, and counting those made the count jump by thousands at the end.
    total = sum(1 for e in entries for p in live if p.supports(e.case) is None)
    with tempfile.TemporaryDirectory(prefix="gradfuzz-replay-") as d:
        ends: list[Ended] = []

        def tick(pending: list[str], running: list[str]) -> None:
            done = sum(_count_lines(_out(d, k), _RAN) for k in groups)
            to_go = sum(1 for k in groups if not os.path.exists(_claim(d, k)))
            progress(tick_line(done, total, len(running), to_go, len(groups)))

        spec = os.path.join(d, "spec.json")
        with open(spec, "w") as fh:
            json.dump({"groups": [[k, names, idx] for k, (names, idx) in groups.items()], "files": files, "folder": d,
                       "options": dataclasses.asdict(options)}, fh)
        unclaimed = list(groups)
        while unclaimed:  # a child that died left groups unclaimed: the next children take them
            argvs = [(f"replay-{len(ends) + i}", ["harness.engine.replay_pool", spec])
                     for i in range(min(workers, len(unclaimed)))]
            run_jobs(argvs, workers, d, ends.append, tick)
            before, unclaimed = unclaimed, [k for k in groups if not os.path.exists(_claim(d, k))]
            if unclaimed == before:  # not one group started: the children die before claiming (their logs say why)
                break
        lines, failures = _collect(d, groups, ends)
    if failures:
        raise ReplayError("; ".join(failures))
    by_file = {os.path.abspath(e.file): e for e in entries}
    by_name = {p.name: p for p in live}
    order_file = {f: i for i, f in enumerate(files)}
    order_path = {p.name: i for i, p in enumerate(live)}
    lines.sort(key=lambda x: (order_file[x["file"]], order_path[x["path"]]))
    return [Replayed(by_file[x["file"]], by_name[x["path"]], x["skipped"],
                     [Divergence.from_json(dv) for dv in x["divergences"]])
            for x in lines]


def _collect(folder: str, groups: dict[str, tuple[list[str], list[int]]],
             ends: list[Ended]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every group's lines, and a sentence for each group that stopped short
    (naming the child's exit and its log) or that no child lived to start."""
    lines: list[dict[str, Any]] = []
    failures = []
    logs = "; ".join(f"{e.key} exited {e.returncode}, its log ends: {e.tail()}" for e in ends if e.returncode != 0)
    for key, (names, idx) in groups.items():
        got = _read_lines(_out(folder, key))
        lines.extend(got)
        want = len(idx) * len(names)
        if len(got) != want:
            started = "stopped" if os.path.exists(_claim(folder, key)) else "was never started"
            failures.append(f"replay of {', '.join(names)} {started} after {len(got)} of {want} (case, path) pairs"
                            + (f" ({logs})" if logs else ""))
    return lines, failures


def _out(folder: str, key: str) -> str:
    return os.path.join(folder, f"{key}.jsonl")


def _claim(folder: str, key: str) -> str:
    return os.path.join(folder, f"{key}.claim")


def _take(folder: str, key: str) -> bool:
    """Claim a group for this child; False if another child has it."""
    try:
        os.close(os.open(_claim(folder, key), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


class ReplayError(RuntimeError):
    """A replay child died or stopped short: part of the replay did not run."""


# What a child's line holds for a pair that ran (``_replay_group`` writes it with json.dumps).
_RAN = b'"skipped": null'


def _count_lines(file: str, holding: bytes = b"") -> int:
    """Whole lines written so far that hold ``holding`` (progress only:
    nothing is parsed)."""
    try:
        with open(file, "rb") as fh:
            return sum(1 for line in fh.read().split(b"\n")[:-1] if holding in line)
    except OSError:
        return 0


def _read_lines(file: str) -> list[dict[str, Any]]:
    """Whole lines only: a child may be writing the last one right now."""
    try:
        with open(file) as fh:
            text = fh.read()
    except OSError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line]


def _child(spec_file: str) -> int:
    from harness.engine.session import _single_thread

    _single_thread()  # N children share the cores, as fuzzing workers do
    os.environ.setdefault(OVERLAP_ENV, "1")  # cases run in order here; the work is shared out by cases
    with open(spec_file) as fh:
        spec = json.load(fh)
    raw = spec["options"]
    options = Options(**{**raw, "extra": tuple(raw["extra"]), "impls": tuple(tuple(x) for x in raw["impls"])})
    entries = [corpus.load(f) for f in spec["files"]]
    for key, names, idx in spec["groups"]:
        if _take(spec["folder"], key):
            _replay_group([entries[i] for i in idx], names, options, _out(spec["folder"], key))
    return 0


def _replay_group(entries: list[corpus.Entry], names: list[str], options: Options, out: str) -> None:
    paths = [p for p in resolve(names, options) if p.name in set(names)]
    try:
        with open(out, "w") as fh:
            for r in replay_entries(entries, paths):
                fh.write(json.dumps({"file": os.path.abspath(r.entry.file), "path": r.path.name, "skipped": r.skipped,
                                     "divergences": [d.to_json() for d in r.divergences]}) + "\n")
                fh.flush()
    finally:
        close_paths(paths)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
