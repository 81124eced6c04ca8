"""Corpus replay on N processes (``gate -n N``): the same results as one process.

Each job is a group of paths that share their setup (a family, a pipeline
schedule, the compile flavours of one backend: pools and compile caches are
built once per job) and replays every corpus case on them in a child process
(``python -m harness.engine.replay_pool SPEC OUT``), N jobs at a time. The
child writes one JSON line per (case, path) as it goes, so the parent shows
progress and keeps what a dead child did finish. The parent hands the
results back in the one-process order (cases, then paths in registry order),
so the gate classifies them exactly as it would in one process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable

from harness.engine.check import Replayed, replay_entries
from harness.observation import Divergence
from harness.artifacts import corpus
from harness.paths import Options, Path, close_paths, resolve
from harness.workers.interpreter import python
from harness.workers.jobs import Ended, run_jobs

def job_key(name: str) -> str:
    """Paths that share setup: ``pipeline.GPipe.stock`` and ``.fixed`` -> ``pipeline.GPipe``."""
    return name.rsplit(".", 1)[0]


def replay_on_workers(entries: list[corpus.Entry], live: list[Path], workers: int, options: Options,
                      progress: Callable[[str], None] = lambda s: None) -> list[Replayed]:
    jobs: dict[str, list[str]] = {}
    for p in live:
        jobs.setdefault(job_key(p.name), []).append(p.name)
    files = [os.path.abspath(e.file) for e in entries]
    total = len(files) * len(live)
    lines: list[dict[str, Any]] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gradfuzz-replay-") as d:
        started = time.monotonic()

        def out(key: str) -> str:
            return os.path.join(d, f"{key}.jsonl")

        def ended(e: Ended) -> None:
            got = _read_lines(out(e.key))
            lines.extend(got)
            want = len(files) * len(jobs[e.key])
            if e.returncode != 0 or len(got) != want:
                failures.append(f"replay of {', '.join(jobs[e.key])} exited {e.returncode} after {len(got)} of {want} "
                                f"(case, path) pairs; its log ends: {e.tail()}")

        def tick(pending: list[str], running: list[str]) -> None:
            done = len(lines) + sum(len(_read_lines(out(k))) for k in running)
            left = (time.monotonic() - started) / done * (total - done) if done else 0.0
            progress(f"[phase] replay {done}/{total} (case, path) pairs on {workers} processes, "
                     f"{len(pending) + len(running)} of {len(jobs)} path groups to go, ~{left:.0f}s left")

        argvs = []
        for key, names in jobs.items():
            spec = os.path.join(d, f"{key}.spec.json")
            with open(spec, "w") as fh:
                json.dump({"paths": names, "files": files, "options": dataclasses.asdict(options)}, fh)
            argvs.append((key, python("harness.engine.replay_pool", spec, out(key))))
        run_jobs(argvs, workers, d, ended, tick)
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


class ReplayError(RuntimeError):
    """A replay child died or stopped short: part of the replay did not run."""


def _read_lines(file: str) -> list[dict[str, Any]]:
    """Whole lines only: a child may be writing the last one right now."""
    try:
        with open(file) as fh:
            text = fh.read()
    except OSError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line]


def _child(spec_file: str, out: str) -> int:
    from harness.engine.session import _single_thread

    _single_thread()  # N children share the cores, as fuzzing workers do
    with open(spec_file) as fh:
        spec = json.load(fh)
    raw = spec["options"]
    options = Options(**{**raw, "extra": tuple(raw["extra"]), "impls": tuple(tuple(x) for x in raw["impls"])})
    paths = [p for p in resolve(spec["paths"], options) if p.name in set(spec["paths"])]
    entries = [corpus.load(f) for f in spec["files"]]
    try:
        with open(out, "w") as fh:
            for r in replay_entries(entries, paths):
                fh.write(json.dumps({"file": os.path.abspath(r.entry.file), "path": r.path.name, "skipped": r.skipped,
                                     "divergences": [d.to_json() for d in r.divergences]}) + "\n")
                fh.flush()
    finally:
        close_paths(paths)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))
