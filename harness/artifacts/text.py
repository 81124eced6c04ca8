"""Text for people: one line, cut at a word, with no path of this machine,
and nothing a terminal would act on.

Reports and progress lines are read on another machine (a CI summary, a
pasted log), where the absolute paths of the machine that ran the gate are
noise at best and a leak at worst, and a cell or line cut mid-word reads as
a different message. Both forms go through here. So does everything the CLI
prints: its streams escape control characters (``escaped_output``), because
keys, titles, summaries and report rows come from strangers' files.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import sys
import sysconfig
from typing import IO, Any, Iterable, Iterator

from harness.case.vocab import printable

ELLIPSIS = "…"
_BREAK_AFTER = " ,;:/)]"  # where a cut may fall when there is no space late enough
# An absolute directory that is not part of a URL (``https://host/x``) or a relative path (``a/b``).
_ABSOLUTE_DIR = re.compile(r"(?<![\w:/.~>\-])(?:/[^\s/'\"(),:;=<>|]+)+/")
PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one_line(text: str) -> str:
    """Whitespace runs (newlines included) as one space, control characters escaped."""
    return printable(" ".join(str(text).split()))


def shorten(text: str, width: int) -> str:
    """``text`` on one line in at most ``width`` characters, cut after a whole
    word and marked with an ellipsis, so what is shown is never a different word."""
    text = one_line(text)
    if len(text) <= width:
        return text
    room = max(width - len(ELLIPSIS), 1)
    head = text[:room]
    if text[room] == " ":  # the cut falls exactly at a word's end
        return head.rstrip(" ,;:") + ELLIPSIS
    cut = head.rfind(" ")
    if cut < room // 2:  # no space late enough: the last other boundary, else a hard cut
        cut = max(head.rfind(c) + 1 for c in _BREAK_AFTER)
    if cut < room // 2:
        cut = room
    return head[:cut].rstrip(" ,;:") + ELLIPSIS


@functools.lru_cache(maxsize=8)
def _roots(cwd: str) -> list[tuple[re.Pattern[str], str]]:
    """Absolute prefixes of this machine and what each becomes: the project
    and the working directory become relative, installed packages their
    import path, the home directory ``~``. Longest first, so a nested root
    wins; a root matches only whole (``/work/main`` is not in ``/work/main2``)."""
    found = {PROJECT: "", cwd: ""}
    for key in ("purelib", "platlib", "stdlib", "platstdlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            found.setdefault(p, "")
    found.setdefault(sys.prefix, "<python>/")
    found.setdefault(os.path.expanduser("~"), "~/")
    roots = sorted(((r.rstrip("/"), v) for r, v in found.items() if len(r.rstrip("/")) > 1), key=lambda rv: -len(rv[0]))
    return [(re.compile(re.escape(r) + r"(/|(?![\w\-]|\.\w))"), v) for r, v in roots]


def scrub(text: str) -> str:
    """``text`` without absolute paths of this machine: known roots made
    relative, and any other absolute directory cut to its corpus folder
    (``cases/split/``) or else to its last part (``…/found/``); control
    characters but newline and tab escaped (reports written to files are
    read with ``cat`` too)."""
    text = printable(str(text), layout=True)
    for root, to in _roots(os.getcwd()):
        text = root.sub(lambda m: to if m.group(1) else to.rstrip("/") or "<project>", text)
    return _ABSOLUTE_DIR.sub(_cut_dir, text)


def scrub_tree(tree: Any, keep: frozenset[str] = frozenset({"case"})) -> Any:
    """A JSON tree with every string ``scrub``bed, except under the keys in
    ``keep`` (a case is data, read back as it was written). A report file
    travels (a CI artifact, a pasted gist): a traceback of a crashed child
    in it must not carry the home or temporary directories of the machine
    that ran it. One walk at the point of writing covers every field,
    including ones added later."""
    if isinstance(tree, str):
        return scrub(tree)
    if isinstance(tree, dict):
        return {k: v if k in keep else scrub_tree(v, keep) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [scrub_tree(v, keep) for v in tree]
    return tree


def _cut_dir(m: re.Match[str]) -> str:
    """An absolute directory as from its corpus folder (``cases/``) on, else ``…/`` and its last part."""
    parts = m.group(0).strip("/").split("/")
    if "cases" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("cases"):]) + "/"
    return f"{ELLIPSIS}/{parts[-1]}/"


def relative(path: str) -> str:
    """A file as a reader finds it: relative to the working directory or the
    project when inside either, else scrubbed."""
    ap = os.path.abspath(path)
    for base in (os.getcwd(), PROJECT):
        if ap == base or ap.startswith(base.rstrip("/") + "/"):
            return os.path.relpath(ap, base)
    return scrub(path)


def terminal_width(default: int = 100) -> int:
    """Columns to fit a line in: the terminal's, else ``$COLUMNS``, else
    ``default`` (a CI log has no width, but a line longer than a screen is
    unread); never under 40."""
    return max(40, shutil.get_terminal_size((default, 24)).columns)


class EscapedStream:
    """A text stream that passes on what it is given with control characters
    escaped (newline and tab kept): every line the CLI prints, whoever built
    it, reaches the terminal as text. ``unescaped`` is the stream below, for
    a display that draws with escapes of its own (rich's live view)."""

    def __init__(self, stream: IO[str]) -> None:
        self.unescaped = stream

    def write(self, text: str) -> int:
        self.unescaped.write(printable(text, layout=True))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for text in lines:
            self.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.unescaped, name)


def unescaped(stream: IO[str]) -> IO[str]:
    """The stream below an ``EscapedStream`` (any other stream as it is)."""
    return getattr(stream, "unescaped", stream)


@contextlib.contextmanager
def escaped_output() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` escaped while the block runs."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = EscapedStream(sys.stdout), EscapedStream(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
