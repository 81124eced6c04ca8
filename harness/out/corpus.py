"""The regression corpus: one JSON file per case, written atomically.

A corpus file is ``{"gradfuzz_corpus": 1, "case": {...}, "meta": {...}}``.
``meta.expect`` lists the divergences that are known and expected on some
torch versions (``{"path": "split.stock", "torch": "<2.13"}``): replay
treats those as expected on matching versions and as regressions of the
fix elsewhere only when the ledger says so; everything else must agree
with the oracle. A file that cannot be read is an error naming the file and
field, never a silent skip.
"""

from __future__ import annotations

import fnmatch
import json
import os
import tempfile
from dataclasses import dataclass, field
import pathlib
from typing import Any, Iterable

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from harness.case.spec import Case, SpecError

CORPUS_VERSION = 1


class CorpusError(ValueError):
    def __init__(self, file: str | os.PathLike, message: str) -> None:
        super().__init__(f"{file}: {message}")
        self.file = str(file)


def covers(patterns: str, path: str) -> bool:
    """Does ``path`` fall under ``patterns``: a path name, a pattern
    ("pipeline.*.stock": every schedule's stock path), or several of them
    separated by commas? The ledger and ``meta.expect`` both name paths so."""
    return any(fnmatch.fnmatchcase(path, p.strip()) for p in patterns.split(","))


@dataclass
class Entry:
    case: Case
    meta: dict[str, Any] = field(default_factory=dict)
    file: str = ""

    def expected_on(self, path: str, torch_version: str) -> bool:
        """Is a divergence of ``path`` on this torch version a known, expected one?"""
        v = Version(torch_version.split("+")[0])
        for e in self.meta.get("expect", []):
            if covers(e.get("path", ""), path) and v in SpecifierSet(e.get("torch", ""), prereleases=True):
                return True
        return False

    def to_json(self) -> dict[str, Any]:
        return {"gradfuzz_corpus": CORPUS_VERSION, "case": self.case.to_json(), "meta": self.meta}


def load(file: str | os.PathLike) -> Entry:
    try:
        text = pathlib.Path(file).read_text()
    except OSError as e:
        raise CorpusError(file, f"cannot read: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CorpusError(file, f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(data, dict):
        raise CorpusError(file, "expected a JSON object with gradfuzz_corpus, case and meta")
    if "gradfuzz_corpus" not in data:
        raise CorpusError(file, "field gradfuzz_corpus: missing (is this a gradfuzz corpus file?)")
    if data["gradfuzz_corpus"] != CORPUS_VERSION:
        raise CorpusError(
            file, f"field gradfuzz_corpus: unknown corpus version {data['gradfuzz_corpus']!r}; this gradfuzz reads {CORPUS_VERSION}"
        )
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise CorpusError(file, "field meta: expected an object")
    for i, e in enumerate(meta.get("expect", [])):
        try:
            SpecifierSet(e.get("torch", ""))
        except (InvalidSpecifier, AttributeError) as err:
            raise CorpusError(file, f"field meta.expect[{i}].torch: {err}") from None
    try:
        case = Case.from_json(data.get("case"))
    except SpecError as e:
        raise CorpusError(file, f"field case.{e}" if not str(e).startswith("case") else f"field {e}") from None
    return Entry(case, meta, str(file))


FINDINGS_MARK = ".gradfuzz.lock"  # every findings folder has its writers' lock file


def discover(targets: Iterable[str | os.PathLike], skipped: list[str] | None = None) -> list[str]:
    """Files and directories -> corpus files (``*.json``), sorted, none lost.

    Inside a directory, hidden folders and findings folders (a fuzzer's
    output, marked by its lock file) are passed over and listed in
    ``skipped``: findings join the corpus when someone files them. A folder
    given by name is read whatever it is."""
    found: list[str] = []
    for t in targets:
        p = pathlib.Path(t)
        if p.is_dir():
            for f in sorted(p.rglob("*.json")):
                rel = f.relative_to(p).parts
                # ledger.json is the known-bug ledger beside the cases, not a case.
                if any(part.startswith(".") for part in rel) or f.name == "ledger.json":
                    continue
                holder = next((p.joinpath(*rel[:i]) for i in range(1, len(rel))
                               if (p.joinpath(*rel[:i]) / FINDINGS_MARK).exists()), None)
                if holder is not None:
                    if skipped is not None and str(holder) not in skipped:
                        skipped.append(str(holder))
                    continue
                found.append(str(f))
        elif p.exists():
            found.append(str(p))
        else:
            raise CorpusError(p, "no such file or directory")
    return found


def atomic_write(path: str | os.PathLike, text: str) -> None:
    """Write via a temp file in the same directory and rename: never a torn file."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def save(directory: str | os.PathLike, name: str, entry: Entry, repro: str | None = None) -> str:
    """Write ``name.json`` (and ``name.py``, the standalone repro) under ``directory``."""
    target = pathlib.Path(directory) / f"{name}.json"
    atomic_write(target, json.dumps(entry.to_json(), indent=1, sort_keys=True) + "\n")
    if repro is not None:
        atomic_write(target.with_suffix(".py"), repro)
    return str(target)
