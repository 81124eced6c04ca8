"""The README and docs/ show what the code does now.

Every ``gradfuzz`` command shown (in code blocks, and in inline code that
starts with ``gradfuzz ``) and every ``python -m harness`` / ``-m harness``
command goes through the CLI's own argument parser, in process; the path
names, corpus files and canary names they mention exist. Every relative
link points to a file (and heading) that exists. Each block that opens with
``$ gradfuzz repro ...`` is run, and what it prints must be what the block
shows. The example path of docs/adding-a-family.md passes the conformance
checks.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import io
import os
import re
import shlex
import sys
from dataclasses import dataclass
from functools import lru_cache

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
# Each family's own page, in its folder: linked from docs/paths.md, not from the front page.
FAMILY_PAGES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "harness", "paths", "*", "README.md")))

# Commands shown with a placeholder that cannot parse, each listed here on
# purpose (nothing is skipped silently); a test checks each is still shown
# and still does not parse. None today.
PLACEHOLDERS: dict[str, str] = {}

FENCE = re.compile(r"^[ \t]*```(\w*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
INLINE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*)`(?!`)")


def _text(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


@dataclass(frozen=True)
class Shown:
    page: str
    line: str  # as shown, prompt and comment included
    argv: tuple[str, ...]  # the CLI's arguments, after `gradfuzz` or `-m harness`

    def __str__(self) -> str:
        return f"{self.page}: {self.line}"


def _argv(line: str) -> tuple[str, ...] | None:
    line = line.strip()
    line = line[2:] if line.startswith("$ ") else line
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    if words[:1] == ["gradfuzz"]:
        return tuple(words[1:])
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "harness":
            return tuple(words[i + 2:])
    return None


@lru_cache(maxsize=None)
def shown_commands() -> tuple[Shown, ...]:
    found: list[Shown] = []
    for page in PAGES + FAMILY_PAGES:
        text = _text(page)
        for lang, body in FENCE.findall(text):
            if lang in ("python", "toml"):
                continue
            for line in body.splitlines():
                for part in line.split(" && "):  # `pip install ... && gradfuzz gate ...`
                    argv = _argv(part)
                    if argv is not None:
                        found.append(Shown(page, part.strip(), argv))
        prose = FENCE.sub("", text)
        for span in INLINE.findall(prose):
            span = " ".join(span.split())
            if span.startswith(("gradfuzz ", "python -m harness ", "torchrun ")):
                argv = _argv(span)
                if argv is not None:
                    found.append(Shown(page, span, argv))
    return tuple(found)


def _parse(argv: tuple[str, ...]):
    from harness.cli.main import build_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return build_parser().parse_args(list(argv)), ""
        except SystemExit:
            return None, err.getvalue().strip()


def test_the_docs_show_commands():
    commands = shown_commands()
    assert len(commands) >= 40, [str(c) for c in commands]
    assert {c.page for c in commands} >= {"README.md", "docs/gate.md", "docs/fuzzing.md", "docs/replay.md"}


@pytest.mark.parametrize("shown", shown_commands(), ids=str)
def test_shown_command_parses(shown):
    if shown.line in PLACEHOLDERS:
        pytest.skip(f"placeholder, listed in PLACEHOLDERS: {PLACEHOLDERS[shown.line]}")
    args, err = _parse(shown.argv)
    assert args is not None, f"{shown} does not parse: {err}"


@lru_cache(maxsize=None)
def _known_paths() -> frozenset[str]:
    from harness.paths import resolve

    return frozenset(p.name for p in resolve(None))


@lru_cache(maxsize=None)
def _known_canaries() -> frozenset[str]:
    from harness.canaries import all_canaries

    return frozenset(c.name for c in all_canaries())


def test_shown_commands_name_what_exists():
    """Path names, corpus files and canary names in the commands are real (a
    command that adds its own paths with --path is checked for the rest)."""
    stale = []
    for shown in shown_commands():
        args, _ = _parse(shown.argv)
        if args is None:
            continue
        if getattr(args, "paths", None) and not getattr(args, "path", None):
            for want in args.paths.split(","):
                if not any(n == want or n.startswith(want + ".") for n in _known_paths()):
                    stale.append(f"{shown}: no path {want!r}")
        for canary in (getattr(args, "canaries", None) or "").split(","):
            if canary and args.command == "selfcheck" and canary not in _known_canaries():
                stale.append(f"{shown}: no canary {canary!r}")
        for word in shown.argv:
            if word.startswith("cases/") and not glob.glob(os.path.join(ROOT, word)):
                stale.append(f"{shown}: no file {word}")
    assert not stale, "\n".join(stale)


def test_placeholders_are_still_shown_and_still_need_listing():
    shown = {c.line: c for c in shown_commands()}
    for line in PLACEHOLDERS:
        assert line in shown, f"{line!r} is no longer in the docs: drop it from PLACEHOLDERS"
        assert _parse(shown[line].argv)[0] is None, f"{line!r} parses now: drop it from PLACEHOLDERS"


def test_pytest_plugin_options_shown_exist():
    from harness import pytest_plugin

    class Group:
        def __init__(self) -> None:
            self.names: set[str] = set()

        def addoption(self, *names, **_kw) -> None:
            self.names.update(names)

    group = Group()

    class Parser:
        def getgroup(self, *_a, **_kw):
            return group

        def addoption(self, *names, **_kw) -> None:
            group.names.update(names)

        def addini(self, *_a, **_kw) -> None:
            pass

    pytest_plugin.pytest_addoption(Parser())
    shown = {m for page in PAGES for m in re.findall(r"--gradfuzz-[a-z-]+[a-z]", _text(page))}
    assert shown, "the plugin's options are documented somewhere"
    assert not shown - group.names, f"documented but not plugin options: {sorted(shown - group.names)}"


# --- links ---------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: str) -> set[str]:
    prose = FENCE.sub("", _text(page))
    return {_slug(h) for h in re.findall(r"^#{1,6} +(.+?) *$", prose, re.M)}


def _links() -> list[tuple[str, str]]:
    out = []
    for page in PAGES + FAMILY_PAGES:
        for target in LINK.findall(FENCE.sub("", _text(page))):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):
                out.append((page, target))
    return out


def test_every_relative_link_points_to_a_file():
    links = _links()
    assert len(links) >= 20
    broken = []
    for page, target in links:
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), file)) if file else os.path.join(ROOT, page)
        if not os.path.exists(dest):
            broken.append(f"{page}: {target} (no file {os.path.relpath(dest, ROOT)})")
        elif anchor and dest.endswith(".md") and anchor not in _anchors(os.path.relpath(dest, ROOT)):
            broken.append(f"{page}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


def test_every_family_has_its_page_in_its_folder_linked_from_the_paths_page():
    from harness.paths import families

    fams = families()
    assert {f.docs for f in fams} == set(FAMILY_PAGES) and len(fams) == len(FAMILY_PAGES)
    paths_page = _text("docs/paths.md")
    assert not [p for p in FAMILY_PAGES if f"](../{p})" not in paths_page]


def test_every_docs_page_is_linked_from_the_readme():
    readme = _text("README.md")
    missing = [p for p in PAGES[1:] if f"]({p})" not in readme]
    assert not missing, f"pages the front page does not link: {missing}"


# --- outputs shown -------------------------------------------------------------------


def _shown_runs() -> list[tuple[str, str, str]]:
    """(page, command, output) of each block that opens with ``$ gradfuzz repro``."""
    runs = []
    for page in PAGES:
        for _lang, body in FENCE.findall(_text(page)):
            first, _, rest = body.partition("\n")
            if first.startswith("$ gradfuzz repro "):
                runs.append((page, first[2:], rest))
    return runs


@pytest.mark.parametrize("page,command,output", _shown_runs(), ids=lambda v: v if v.endswith(".md") else "")
def test_shown_output_is_what_the_command_prints(page, command, output, capsys, monkeypatch):
    """The output is shown wrapped; compared word for word."""
    from harness.cli.main import main

    monkeypatch.chdir(ROOT)
    main(shlex.split(command)[1:])
    printed = capsys.readouterr().out
    assert printed.split() == output.split(), f"{page}: `{command}` now prints:\n{printed}"


def test_some_outputs_are_checked():
    assert {p for p, _, _ in _shown_runs()} >= {"README.md", "docs/reports.md"}


# --- the example path of docs/adding-a-family.md ---------------------------------------


def test_the_example_path_conforms(tmp_path, monkeypatch):
    from harness.paths import Options, resolve
    from tests.cover.test_conformance import check_path

    blocks = [body for lang, body in FENCE.findall(_text("docs/adding-a-family.md")) if lang == "python"]
    assert len(blocks) == 1
    (tmp_path / "team_paths.py").write_text(blocks[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("team_paths", None)
    try:
        paths = resolve("team", Options(extra=("team_paths:paths",)))  # as --path team_paths:paths does
        assert [p.name for p in paths] == ["team.loss"]
        for p in paths:
            check_path(p)
    finally:
        sys.modules.pop("team_paths", None)
