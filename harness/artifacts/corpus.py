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
from typing import Any, Callable, Iterable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from harness.case import schema as sc
from harness.case.spec import Case, SpecError
from harness.observation import FINDING_CLASSES

CORPUS_VERSION = 1


CorpusError = sc.FileError  # the one error type of every file loader: exit 2 naming file and field


def covers(patterns: str, path: str) -> bool:
    """Does ``path`` fall under ``patterns``: a path name, a pattern
    ("pipeline.*.stock": every schedule's stock path), or several of them
    separated by commas? The ledger and ``meta.expect`` both name paths so."""
    return any(fnmatch.fnmatchcase(path, p.strip()) for p in patterns.split(","))


def installed(package: str) -> str | None:
    """The version of distribution ``package`` installed here, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _relation(spec: str, version: str) -> str:
    v = Version(version.split("+")[0])
    specs = SpecifierSet(spec, prereleases=True)
    if v in specs:
        return "in"
    uppers = [Version(s.version) for s in specs if s.operator in ("<", "<=")]
    return "after" if uppers and any(v >= u for u in uppers) else "before"


def relation(torch_range: str, packages: dict[str, str], torch_version: str,
             have: Callable[[str], str | None] = installed) -> str:
    """Where this environment stands to an affected range: ``in`` it,
    ``after`` it (fixed since) or ``before`` it. A range names torch and,
    for bugs of a training stack, that stack's releases (``{"deepspeed":
    ">=0.16,<0.18"}``); every part must hold. A stack not installed here is
    ``before``: its bug cannot show. The one rule of the ledger, ``meta.expect``
    and replay alike."""
    rel = _relation(torch_range, torch_version)
    for package, spec in sorted(packages.items()):
        if rel != "in":
            break
        v = have(package)
        rel = "before" if v is None else _relation(spec, v)
    return rel


@dataclass
class Entry:
    case: Case
    meta: dict[str, Any] = field(default_factory=dict)
    file: str = ""

    def expected_on(self, path: str, torch_version: str) -> bool:
        """Is a divergence of ``path`` on this torch version (and the stacks
        installed here) a known, expected one?"""
        return any(covers(e.get("path", ""), path)
                   and relation(e.get("torch", ""), e.get("packages", {}), torch_version) == "in"
                   for e in self.meta.get("expect", []))

    def to_json(self) -> dict[str, Any]:
        return {"gradfuzz_corpus": CORPUS_VERSION, "case": self.case.to_json(), "meta": self.meta}


def _expect(v: Any, where: str) -> Any:
    for i, e in enumerate(sc.array(v, where, 64)):
        w = f"{where}[{i}]"
        sc.obj(e, w, ("path",), ("torch", "packages", "note"))
        sc.string(e["path"], f"{w}.path", max_len=256)
        sc.string(e.get("note", ""), f"{w}.note", max_len=sc.MAX_TEXT)
        sc.version_range(e.get("torch", ""), f"{w}.torch")
        sc.package_ranges(e.get("packages", {}), f"{w}.packages")
    return v


def _float_or_none(v: Any, where: str) -> Any:
    # max_abs/ratio may be inf/nan in a record of what was seen; only their type matters.
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise SpecError(where, f"expected a number or null, got {sc._show(v)}")
    return v


def _microbatch(v: Any, where: str) -> Any:
    """The backward a divergence was seen after (0 or more), or null: seen
    outside any backward (an error before the first, a hang or crash of a
    whole process group)."""
    if v is None:
        return v
    if type(v) is int and v < 0:
        raise SpecError(where, f"{v} is not a backward number: a divergence seen outside any backward has "
                               "microbatch null (older gradfuzz wrote -1 there: set it to null, or delete "
                               "the file and let the next run save the finding again)")
    return sc.integer(v, where, 0, 2**20)


MAX_DIVERGENCES = 64  # divergences a corpus file's meta records (the writers keep the first ones)


def finding_class(v: Any, where: str) -> str:
    """A finding's class (``harness.observation.FINDING_CLASSES``): ``bug``
    or ``misuse``; the one check of every record that carries it (a finding's
    meta and divergences, a ledger entry, a gate report row)."""
    return sc.string(v, where, choices=FINDING_CLASSES)


def _divergences(v: Any, where: str) -> Any:
    text = lambda x, w: sc.string(x, w, max_len=sc.MAX_CORPUS_BYTES)  # noqa: E731
    opt = lambda f: lambda x, w: None if x is None else f(x, w)  # noqa: E731
    checks = {"path": text, "kind": text, "param": opt(text), "microbatch": _microbatch,
              "max_abs": _float_or_none, "max_rel": _float_or_none, "ratio": _float_or_none, "detail": text,
              "signature": lambda x, w: x if x == "" else sc.signature(x, w), "flaky": sc.boolean, "shape": text,
              "finding_class": finding_class}
    for i, d in enumerate(sc.array(v, where, MAX_DIVERGENCES)):
        sc.obj(d, f"{where}[{i}]", (), checks)
        for k, x in d.items():
            checks[k](x, f"{where}[{i}].{k}")
    return v


MAX_COUNT = 2**53  # finds of one signature: exact in every JSON reader
_count = lambda v, w: sc.integer(v, w, 0, MAX_COUNT)  # noqa: E731
_text = lambda v, w: sc.string(v, w, max_len=sc.MAX_TEXT)  # noqa: E731
# Every field a corpus file's meta may hold, and its check. Written by the
# harness (signature, counts, found_with, ...) or by people (title, notes, expect).
META_FIELDS: dict[str, Any] = {
    "title": sc.line, "source": _text, "analysis": _text, "notes": _text, "upstream": _text,
    "signature": sc.signature,
    "count": _count,
    "counts": lambda v, w: sc.dict_of(v, w, _count, 4096),
    "first_seen": lambda v, w: sc.string(v, w, max_len=64), "last_seen": lambda v, w: sc.string(v, w, max_len=64),
    "flaky": sc.boolean,
    "expect": _expect,
    "found_with": lambda v, w: (sc.obj(v, w, (), ("path", "torch")), sc.path_name(v.get("path", ""), f"{w}.path"),
                                sc.line(v.get("torch", ""), f"{w}.torch", 64)),
    "checked": lambda v, w: sc.dict_of(v, w, _text, 64),
    "divergences": _divergences,
    "finding_class": finding_class,
}


def check_meta(meta: Any, where: str = "meta") -> dict[str, Any]:
    """A corpus entry's meta, field by field (SpecError naming the field)."""
    sc.obj(meta, where, (), META_FIELDS)
    for k, v in meta.items():
        META_FIELDS[k](v, f"{where}.{k}")
    return meta


def from_json(data: Any, file: str) -> Entry:
    """A parsed corpus file (or Redis item) -> Entry; FileError naming ``file`` and the field."""
    if not isinstance(data, dict):
        raise CorpusError(file, "expected a JSON object with gradfuzz_corpus, case and meta")
    if "gradfuzz_corpus" not in data:
        raise CorpusError(file, "field gradfuzz_corpus: missing (is this a gradfuzz corpus file?)")
    unknown = sorted(str(k) for k in data if k not in ("gradfuzz_corpus", "case", "meta"))
    if unknown:
        raise CorpusError(file, f"field {unknown[0][:64]}: unknown field (a corpus file has gradfuzz_corpus, case, meta)")
    if "case" not in data:
        raise CorpusError(file, "field case: missing")
    v = data["gradfuzz_corpus"]
    if type(v) is not int or v != CORPUS_VERSION:
        raise CorpusError(file, f"field gradfuzz_corpus: unknown corpus version {sc._show(v)}; this gradfuzz reads {CORPUS_VERSION}")
    meta = data.get("meta", {})
    try:
        check_meta(meta)
    except SpecError as e:
        raise CorpusError(file, f"field {e}") from None
    try:
        case = Case.from_json(data["case"])
    except SpecError as e:
        raise CorpusError(file, f"field case.{e}" if not str(e).startswith("case") else f"field {e}") from None
    return Entry(case, meta, str(file))


def load(file: str | os.PathLike) -> Entry:
    """A corpus file, checked whole (size, encoding, nesting, every field) before anything is built."""
    return from_json(sc.read_json(file, sc.MAX_CORPUS_BYTES, "corpus file"), str(file))


def migrate(file: str | os.PathLike) -> bool:
    """Rewrite ``file`` in the current case schema if it holds an older one
    (``gradfuzz replay --migrate``); True when it was rewritten. Reading
    migrates an old file in memory anyway; this makes the file say so."""
    data = sc.read_json(file, sc.MAX_CORPUS_BYTES, "corpus file")
    entry = from_json(data, str(file))
    if data["case"].get("version") == entry.case.version:
        return False
    atomic_write(file, json.dumps(entry.to_json(), indent=1, sort_keys=True) + "\n")
    return True


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
            for f in sorted(_json_files(p)):
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


MAX_TREE_DEPTH = 32  # folders below a corpus directory (the corpus uses 1)
MAX_TREE_ENTRIES = 200_000  # files and folders one discovery looks at


def _json_files(root: pathlib.Path) -> list[pathlib.Path]:
    """``*.json`` under ``root``, walked with a stack, not recursion (a tree
    10,000 folders deep ended in RecursionError), bounded in depth and size,
    without following links to folders (no cycles). Whatever is named
    ``*.json`` is listed; reading refuses what is not a regular file."""
    found, stack, seen = [], [(root, 0)], 0
    while stack:
        folder, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            raise CorpusError(folder, f"more than {MAX_TREE_DEPTH} folders below {root}; a corpus is shallower")
        try:
            entries = list(os.scandir(folder))
        except OSError as e:
            raise CorpusError(folder, f"cannot list the folder: {e.strerror}") from None
        seen += len(entries)
        if seen > MAX_TREE_ENTRIES:
            raise CorpusError(root, f"more than {MAX_TREE_ENTRIES} files and folders; is this a corpus?")
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                stack.append((pathlib.Path(e.path), depth + 1))
            elif e.name.endswith(".json"):
                found.append(pathlib.Path(e.path))
    return found


def atomic_write(path: str | os.PathLike, text: str) -> None:
    """Write via a temp file in the same directory and rename: never a torn file."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; CI publishes findings, so follow the umask
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # repro scripts hold titles in any script
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


def _umask() -> int:
    """The process umask (read by setting and restoring it: there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save(directory: str | os.PathLike, name: str, entry: Entry, repro: str | None = None) -> str:
    """Write ``name.json`` (and ``name.py``, the standalone repro) under ``directory``.

    The files stay inside ``directory``, and a repro script is never written
    under a name Python could import (``torch.py`` beside other scripts would
    run whenever one of them does): findings are named by signature, which
    has dashes (``harness.artifacts.findings.record`` insists on one)."""
    pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
    target = sc.safe_target(directory, name, ".json", signature=False)
    if repro is not None and name.isidentifier():
        raise SpecError("name", f"{name!r}: a repro script {name}.py could be imported as a module; "
                                "name it by its signature")
    atomic_write(target, json.dumps(entry.to_json(), indent=1, sort_keys=True) + "\n")
    if repro is not None:
        atomic_write(target.with_suffix(".py"), repro)
    return str(target)
