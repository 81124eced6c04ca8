"""Every file gradfuzz reads is input from a stranger: typed, bounded reading.

Corpora travel (Redis finding logs, ``gradfuzz merge`` of directories copied
from other machines, cases pasted from bug reports), so a corpus file, a
ledger, a Redis item or a gate report is checked here before anything is
built from it: a size limit before the bytes are read, strict UTF-8, a
nesting limit, and then one typed check per field (a bool is not an int,
``"no"`` is not false, NaN is not a number, every list has a length bound).
A violation is a ``SpecError`` naming the field; the loaders wrap it in a
``FileError`` naming the file, which the CLI turns into exit 2.

The same module owns the two facts that make names safe to use as files: a
signature is the harness's own hash format (``<path>-<kind>-<10 hex>``) and
nothing else, and a file is written only inside its target folder under a
name Python could never import.
"""

from __future__ import annotations

import hashlib
import json
import keyword
import math
import os
import re
import stat
from pathlib import Path as FsPath
from typing import Any, Iterable

from harness.case.vocab import CONTROL, SpecError, printable

# Bounds. Generated cases stay far inside them (the generator's largest is a
# few dozen nodes); they exist so a hostile file is refused before it costs.
MAX_CORPUS_BYTES = 4 * 2**20
MAX_LEDGER_BYTES = 8 * 2**20
MAX_REPORT_BYTES = 64 * 2**20
MAX_ITEM_BYTES = 4 * 2**20  # one Redis finding
MAX_DEPTH = 32  # JSON nesting (a case is about 6 deep)
MAX_NAME = 64
MAX_TEXT = 64 * 1024  # titles, notes, analyses
MAX_LIST = 256

PATH_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")
SIGNATURE_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*-[a-z_]+-[0-9a-f]{10}$")
# Names a generated script binds itself: a case value of that name would shadow them.
RESERVED_NAMES = frozenset({"v", "torch", "sys", "math", "forward", "LayoutMatmul", "Pair", "self", "dist",
                            "os", "multiprocessing", "tempfile", "Schedule", "Stage"})


class FileError(ValueError):
    """A file (or Redis item) that cannot be read as what it claims to be."""

    def __init__(self, file: str | os.PathLike, message: str) -> None:
        super().__init__(f"{printable(str(file))}: {printable(message)}")  # a file's name is a stranger's text too
        self.file = str(file)


# --- reading --------------------------------------------------------------------------

def read_json(file: str | os.PathLike, max_bytes: int, what: str) -> Any:
    """A JSON file, read within ``max_bytes``, strict UTF-8, nesting within MAX_DEPTH."""
    raw = read_regular(file, max_bytes, what)
    try:
        return parse_json(raw, what)
    except SpecError as e:
        raise FileError(file, message(e)) from None


def read_regular(file: str | os.PathLike, max_bytes: int, what: str) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``. Opened without
    blocking and checked before a byte is read: a FIFO named ``*.json`` would
    otherwise wait for a writer forever, and ``/dev/zero`` never ends."""
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise FileError(file, f"cannot read {what}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileError(file, f"not a regular file ({_file_kind(info.st_mode)}); a {what} is a plain file")
        if info.st_size > max_bytes:
            raise FileError(file, f"larger than the {max_bytes // 2**20} MiB a {what} may be; is this a {what}?")
        raw = fh.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise FileError(file, f"larger than the {max_bytes // 2**20} MiB a {what} may be; is this a {what}?")
    return raw


def _file_kind(mode: int) -> str:
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a character device",
             stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}
    return next((k for test, k in kinds.items() if test(mode)), "not a plain file")


def parse_json(raw: bytes | str, what: str) -> Any:
    """Bytes -> JSON value; every failure is a SpecError (never a RecursionError).
    A key repeated in one object is a failure too: JSON leaves it undefined
    and Python keeps the last, so the file a person reviews and the one
    gradfuzz runs would differ."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SpecError("json", f"{what} is not UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})") from None
    else:
        text = raw
    if not text.strip():
        raise SpecError("json", f"empty {what}")
    depth = _bracket_depth(text)
    if depth > MAX_DEPTH:
        raise SpecError("json", f"{what} nests {depth} levels deep; at most {MAX_DEPTH}")
    repeated: list[_Repeated] = []
    try:
        value = json.loads(text, object_pairs_hook=lambda pairs: _object(pairs, repeated))
    except json.JSONDecodeError as e:
        raise SpecError("json", f"{what} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except (ValueError, RecursionError) as e:  # e.g. an integer of more than 4300 digits
        raise SpecError("json", f"{what} is not usable JSON: {str(e)[:200]}") from None
    if repeated:
        where, key, times = _first_repeat(value, repeated)
        raise SpecError(_join(where, key[:MAX_NAME]), f"duplicate key: this object holds {key[:MAX_NAME]!r} {times} times "
                        f"(a JSON reader keeps only the last one, silently); write it once in {what}")
    return value


class _Repeated(dict):
    """An object that held a key more than once, kept so that the key can be
    named with the field path it sits at once the whole file is parsed (the
    hook sees an object before it knows where it goes)."""

    key: str = ""
    times: int = 0


def _object(pairs: list[tuple[str, Any]], repeated: list[_Repeated]) -> dict[str, Any]:
    """``json.loads``' object hook: a repeated key is refused, never resolved
    by letting the last one win (a reviewer reading the first would see a
    different file from the one gradfuzz runs)."""
    out = dict(pairs)
    if len(out) == len(pairs):
        return out
    seen: dict[str, int] = {}
    for k, _ in pairs:
        seen[k] = seen.get(k, 0) + 1
    marked = _Repeated(out)
    marked.key, marked.times = next((k, n) for k, n in seen.items() if n > 1)
    repeated.append(marked)
    return marked


def _first_repeat(value: Any, repeated: list[_Repeated]) -> tuple[str, str, int]:
    """The first object in ``value`` (in file order) that repeated a key, with
    its field path (``bugs[3]``); depth is bounded by MAX_DEPTH before
    parsing, so the walk is too. None reachable (the repeat sat inside a
    value that a repeated key then dropped): the first one, at no path."""
    marked = {id(m) for m in repeated}
    todo: list[tuple[Any, str]] = [(value, "")]
    while todo:
        v, where = todo.pop()
        if id(v) in marked:
            return where, v.key, v.times
        if isinstance(v, dict):
            todo.extend((x, _join(where, str(k)[:MAX_NAME])) for k, x in reversed(list(v.items())))
        elif isinstance(v, list):
            todo.extend((x, f"{where}[{i}]") for i, x in reversed(list(enumerate(v))))
    return "", repeated[0].key, repeated[0].times


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def _bracket_depth(text: str) -> int:
    """The deepest bracket nesting outside strings, found without recursion."""
    depth = top = 0
    for m in _BRACKETS.finditer(_STRINGS.sub("", text)):
        if m.group() in "[{":
            depth += 1
            if depth > top:
                top = depth
                if top > MAX_DEPTH:
                    return top
        else:
            depth -= 1
    return top


def message(e: SpecError) -> str:
    """The error as a loader reports it: ``field X: ...``, or the bare message for
    a file that is not JSON at all."""
    text = str(e).split(": ", 1)[1] if ": " in str(e) else str(e)
    return text if e.where == "json" else f"field {e.where}: {text}"


# --- typed fields ---------------------------------------------------------------------

def _kind(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(v), type(v).__name__)


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def obj(v: Any, where: str, required: Iterable[str] = (), optional: Iterable[str] = (), *,
        open_keys: bool = False) -> dict[str, Any]:
    """An object with exactly these keys (``open_keys``: any string keys)."""
    if not isinstance(v, dict):
        raise SpecError(where, f"expected an object, got {_kind(v)}")
    required = tuple(required)
    for k in required:
        if k not in v:
            raise SpecError(_join(where, k), "missing field")
    if not open_keys:
        allowed = set(required) | set(optional)
        unknown = sorted(k for k in v if k not in allowed)
        if unknown:
            raise SpecError(_join(where, str(unknown[0])[:MAX_NAME]),
                            f"unknown field (known: {', '.join(sorted(allowed))})")
    return v


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def string(v: Any, where: str, *, max_len: int = MAX_NAME, choices: Iterable[str] | None = None,
           pattern: re.Pattern | None = None, empty: bool = True) -> str:
    if not isinstance(v, str):
        raise SpecError(where, f"expected a string, got {_kind(v)} {_show(v)}")
    if len(v) > max_len:
        raise SpecError(where, f"a string of {len(v)} characters; at most {max_len}")
    if not empty and not v:
        raise SpecError(where, "must not be empty")
    if choices is not None:
        choices = tuple(choices)
        if v not in choices:
            raise SpecError(where, f"unknown {_show(v)}; one of {', '.join(map(repr, choices))}")
    if pattern is not None and not pattern.match(v):
        raise SpecError(where, f"{_show(v)} does not match {pattern.pattern}")
    return v


def boolean(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise SpecError(where, f"expected true or false, got {_kind(v)} {_show(v)}")
    return v


def integer(v: Any, where: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpecError(where, f"expected an integer in {lo}..{hi}, got {_kind(v)} {_show(v)}")
    if not lo <= v <= hi:
        raise SpecError(where, f"expected an integer in {lo}..{hi}, got {_show(v)}")
    return v


def number(v: Any, where: str, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """A finite number (an integer is fine, a bool is not)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SpecError(where, f"expected a number, got {_kind(v)} {_show(v)}")
    if isinstance(v, float) and not math.isfinite(v):
        raise SpecError(where, f"expected a finite number, got {v}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise SpecError(where, f"expected a number in {'(' if lo_open else '['}{lo}, {hi}], got {_show(v)}")
    return v


def array(v: Any, where: str, max_items: int = MAX_LIST) -> list[Any]:
    if not isinstance(v, list):
        raise SpecError(where, f"expected a list, got {_kind(v)} {_show(v)}")
    if len(v) > max_items:
        raise SpecError(where, f"{len(v)} items; at most {max_items}")
    return v


def name(v: Any, where: str) -> str:
    """A name that becomes a Python identifier in a generated script."""
    string(v, where, max_len=MAX_NAME, empty=False)
    if not v.isidentifier() or not v.isascii():
        raise SpecError(where, f"{_show(v)} is not a valid identifier (letters, digits, _)")
    if keyword.iskeyword(v) or keyword.issoftkeyword(v) or v in RESERVED_NAMES or v.startswith("__"):
        raise SpecError(where, f"{_show(v)} is a Python keyword or a name repro scripts use; rename it")
    return v


def _control(c: str) -> bool:
    return CONTROL.match(c) is not None


def line(v: Any, where: str, max_len: int = 1000) -> str:
    """One line of text (a title): no newlines or other control characters."""
    string(v, where, max_len=max_len)
    bad = next((c for c in v if _control(c)), None)
    if bad is not None:
        raise SpecError(where, f"one line of text expected; it holds the control character {bad!r}")
    return v


def to_line(text: str, max_len: int = 1000) -> str:
    """Any text made into what ``line`` takes: whitespace runs become one space,
    other control characters (an ANSI colour escape in an exception message)
    are dropped, and it is cut to ``max_len``."""
    return " ".join("".join(c for c in str(text) if c.isspace() or not _control(c)).split())[:max_len]


_ASCII_INT = re.compile(r"[0-9]{1,9}")


def ascii_int(text: str) -> int | None:
    """The number ASCII digits spell, else None. ``str.isdigit`` takes "²" (then
    ``int`` raises) and "١" (``int`` reads 1 and other code reads nothing): a
    number in text is ASCII digits only, and at most nine of them."""
    return int(text) if _ASCII_INT.fullmatch(text) else None


def path_name(v: Any, where: str) -> str:
    """A path's name (``split.stock``, ``pipeline.GPipe.ranks2.fixed``)."""
    string(v, where, max_len=128)
    if v and not PATH_NAME_RE.match(v):
        raise SpecError(where, f"{_show(v)} is not a path name (dotted identifiers, e.g. split.stock)")
    return v


def signature(v: Any, where: str) -> str:
    """The harness's own signature format, and nothing else (it becomes a file name)."""
    string(v, where, max_len=160)
    if not SIGNATURE_RE.match(v):
        raise SpecError(where, f"{_show(v)} is not a gradfuzz signature (PATH-KIND-<10 hex digits>)")
    return v


def case_signature(case_json: dict[str, Any]) -> str:
    """A signature for a case filed without one (a hand-written corpus file):
    the hash of its content, in the one signature format."""
    digest = hashlib.sha1(json.dumps(case_json, sort_keys=True).encode()).hexdigest()[:10]
    return f"corpus-case-{digest}"


def dict_of(v: Any, where: str, value: Any, max_items: int = MAX_LIST) -> dict[str, Any]:
    """An object with string keys (bounded) and values checked by ``value(v, where)``."""
    obj(v, where, open_keys=True)
    if len(v) > max_items:
        raise SpecError(where, f"{len(v)} entries; at most {max_items}")
    for k, x in v.items():
        string(k, f"{where} key", max_len=256)
        value(x, f"{where}[{k!r}]")
    return v


# --- writing --------------------------------------------------------------------------

_FILE_STEM = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def safe_target(directory: str | os.PathLike, stem: str, suffix: str, *, signature: bool = True) -> FsPath:
    """``directory/stem+suffix``, refused unless it stays inside ``directory``.

    With ``signature`` (names that come from data: findings, merges, Redis)
    the stem must be a gradfuzz signature, which has dashes and so can never
    be imported (a ``torch.py`` beside repro scripts would run whenever one of
    them does). Without it (a corpus file a person names), a plain file name."""
    if not isinstance(stem, str) or not (SIGNATURE_RE if signature else _FILE_STEM).match(stem) or len(stem) > 160:
        what = "a gradfuzz signature (PATH-KIND-<10 hex digits>)" if signature else "a plain file name"
        raise SpecError("signature" if signature else "name", f"{_show(stem)} is not {what}, so it is not written as a file")
    base = FsPath(directory).resolve()
    target = (base / f"{stem}{suffix}").resolve()
    if target.parent != base:
        raise SpecError("signature" if signature else "name", f"{_show(stem)} would write outside {base}")
    return target


_PACKAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def package_ranges(v: Any, where: str) -> dict[str, str]:
    """Affected releases of training stacks: ``{"deepspeed": ">=0.16,<0.18"}``
    (distribution names, PEP 440 specifiers)."""
    if type(v) is not dict:
        raise SpecError(where, f"expected an object of package: version range, got {_show(v)}")
    if len(v) > 8:
        raise SpecError(where, f"{len(v)} packages; at most 8")
    for name, spec in v.items():
        string(name, f"{where} key", max_len=64, pattern=_PACKAGE)
        version_range(spec, f"{where}.{name}")
    return v


def version_range(v: Any, where: str) -> str:
    """A PEP 440 specifier of versions (``"<2.13"``, ``">=2.11"``)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    string(v, where, max_len=64)
    try:
        SpecifierSet(v)
    except InvalidSpecifier as e:
        raise SpecError(where, f"not a version range: {e}") from None
    return v
