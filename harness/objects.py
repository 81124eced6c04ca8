"""``MODULE:ATTR`` references: the one way a name becomes an object.

Implementations under test arrive as names: ``--split-impl``, ``--path``,
``--graphed-impl``, a worker's job, a rank's stage class, a repro script's
import line. They all go through ``Ref`` so that they accept the same forms,
fail with the same message, and are checked to be dotted identifiers before
anything imports them or pastes them into generated source.
"""

from __future__ import annotations

import importlib
import keyword
import re
from dataclasses import dataclass
from typing import Any, Callable

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


class LoadError(ValueError):
    """A reference that does not parse, import or pass its check."""


def _dotted(text: str) -> bool:
    return bool(_DOTTED.match(text)) and not any(keyword.iskeyword(p) for p in text.split("."))


@dataclass(frozen=True)
class Ref:
    """``module`` plus an optional dotted ``attr`` inside it ("" = the module itself)."""

    module: str
    attr: str = ""

    @classmethod
    def parse(cls, spec: str, what: str = "reference", *, require_attr: bool = False, default_attr: str = "") -> "Ref":
        if not isinstance(spec, str):
            raise LoadError(f"{what}: expected MODULE[:ATTR] as a string, got {type(spec).__name__}")
        module, _, attr = spec.partition(":")
        attr = attr or default_attr
        if require_attr and not attr:
            raise LoadError(f"{what} {spec!r}: expected MODULE:ATTR")
        if not _dotted(module) or (attr and not _dotted(attr)):
            raise LoadError(f"{what} {spec!r}: MODULE and ATTR must be dotted Python identifiers")
        return cls(module, attr)

    def __str__(self) -> str:
        return f"{self.module}:{self.attr}" if self.attr else self.module

    def load(self, what: str = "reference") -> Any:
        try:
            obj: Any = importlib.import_module(self.module)
        except ImportError as e:
            raise LoadError(f"{what} {str(self)!r}: cannot import {self.module!r} ({e})") from None
        for part in filter(None, self.attr.split(".")):
            if not hasattr(obj, part):
                raise LoadError(f"{what} {str(self)!r}: {self.module} has no attribute {self.attr!r}")
            obj = getattr(obj, part)
        return obj

    def import_line(self, alias: str) -> str:
        """Source that binds the object to ``alias`` in a generated script."""
        if not _dotted(alias) or "." in alias:
            raise LoadError(f"alias {alias!r} is not an identifier")
        if not self.attr:
            return f"import {self.module} as {alias}"
        head, _, rest = self.attr.partition(".")
        if not rest:
            return f"from {self.module} import {head} as {alias}"
        return f"import {self.module}\n{alias} = {self.module}.{self.attr}"


def load_object(
    spec: str,
    what: str = "reference",
    *,
    require_attr: bool = False,
    default_attr: str = "",
    check: Callable[[Any], str | None] | None = None,
) -> Any:
    """Parse, import and check ``spec``; ``check`` returns why the object is unfit, or None."""
    obj = Ref.parse(spec, what, require_attr=require_attr, default_attr=default_attr).load(what)
    problem = check(obj) if check is not None else None
    if problem:
        raise LoadError(f"{what} {spec!r} {problem}")
    return obj
