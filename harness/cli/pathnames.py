"""Path names as a person types them: an unknown one answered with the
names it is closest to, not a line of every path there is.

``harness.paths.resolve`` refuses an unknown name with the whole list (95
names on one line); the commands resolve through here, which asks again,
only after such a refusal, which names are unknown and what they resemble.
"""

from __future__ import annotations

import difflib
from typing import Iterable

from harness.paths import Options, Path, UsageError, all_paths, resolve


def resolve_paths(selection: Iterable[str] | str | None, options: Options = Options()) -> list[Path]:
    """``resolve``, with "did you mean" for a name no path or family has."""
    try:
        return resolve(selection, options)
    except UsageError as refused:
        wants = [s.strip() for s in (selection.split(",") if isinstance(selection, str) else selection or ())]
        names = [p.name for p in all_paths(options)]
        unknown = [w for w in wants if w and not any(n == w or n.startswith(w + ".") for n in names)]
        if not unknown:
            raise refused
        raise UsageError(unknown_message(unknown[0], names)) from None


def unknown_message(want: str, names: list[str]) -> str:
    """One line: the unknown name, the closest paths or families, and where the whole list is."""
    families = sorted({n.split(".")[0] for n in names})
    close = difflib.get_close_matches(want, names + families, n=3, cutoff=0.6)
    hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close
            else f"families: {', '.join(families)}")
    return (f"unknown path {want!r}: {hint} (`gradfuzz paths` lists all {len(names)} paths; "
            "a family name such as 'split' picks all of it)")
