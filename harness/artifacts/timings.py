"""What the last run of one fuzz plan took, path by path.

An examples budget draws the same cases on every run of the same plan
(paths, examples, seed, torch), so each target's seconds, shrinking
included, repeat up to the machine's speed. Examples are a poor unit of
work for an ETA: a compile structure costs seconds where a split case costs
milliseconds, and a target that finds a bug spends minutes shrinking it.
The last run's seconds are a unit that already holds all of that
(``harness.cli.progress.fuzz_left``). A plan never run here reads the
seconds gradfuzz ships for it, if any (``REFERENCE_DIR``: the README's
gate on the 2-core machine the docs measure on), so a fresh checkout's CI
log gets the same unit of work; only their proportions matter, the pace
is this run's. Other plans have no history, and their ETA waits until it
holds steady.

The file is read as untrusted input, as every file gradfuzz reads is: a bad
one is an error naming it and its field (delete it to start over).
"""

from __future__ import annotations

import hashlib
import json
import os

from harness.artifacts.corpus import atomic_write
from harness.case import schema as sc
from harness.case.spec import SpecError

TIMINGS_DIR = os.path.join(".gradfuzz", "timings")
REFERENCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference_timings")
MAX_BYTES = 1 << 20
MAX_PATHS = 10_000
MAX_SECONDS = 1e7


def plan_key(selection: str, examples: int, seed: int, torch_version: str) -> str:
    """The plan a history belongs to (``--paths`` as given): another budget,
    seed, selection or torch draws other cases."""
    text = json.dumps([selection, examples, seed, torch_version.split("+")[0]])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _file(key: str, root: str) -> str:
    return os.path.join(root, f"{key}.json")


def load(key: str, root: str = TIMINGS_DIR) -> dict[str, float]:
    """Seconds per path of the last complete run of the plan ``key`` ({} if none ran here)."""
    file = _file(key, root)
    if not os.path.exists(file):
        return {}
    data = sc.read_json(file, MAX_BYTES, "timings file")
    try:
        sc.obj(data, "", ("paths",), ())
        return {k: float(v) for k, v in sc.dict_of(data["paths"], "paths",
                                                    lambda x, w: sc.number(x, w, 0.0, MAX_SECONDS),
                                                    max_items=MAX_PATHS).items()}
    except SpecError as e:
        what = f"field {e}" if e.where else "expected a JSON object with paths"
        raise sc.FileError(file, f"{what} (a cache of run times: delete the file to start over)") from None


def load_or_reference(key: str, root: str = TIMINGS_DIR) -> dict[str, float]:
    """This machine's last run of the plan, else the one gradfuzz ships for it ({} if neither)."""
    return load(key, root) or load(key, REFERENCE_DIR)


def save(key: str, seconds: dict[str, float], root: str = TIMINGS_DIR) -> None:
    """Record a complete run's seconds per path for the next run of the same plan."""
    atomic_write(_file(key, root), json.dumps({"paths": {k: round(v, 2) for k, v in sorted(seconds.items())}}) + "\n")
