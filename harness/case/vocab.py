"""The case schema's vocabulary: versions, allowed values, the one input error.

Both the spec (decoding JSON) and the validator (shapes, ranges) need these;
keeping them here lets the spec call the validator without the validator
importing the spec back.
"""

from __future__ import annotations

import re

SCHEMA_VERSION = 2  # 2: stage cuts and data-parallel switches moved into their families (Case.family)

DTYPES = ("float32", "float64")
GRAD_INITS = ("none", "zero", "prefilled")
ZERO_GRADS = ("set_to_none", "zeros", "keep")
HOOK_KINDS = ("scale", "observe")
# Buffer-lifetime schedule parts (see Schedule.events / param_hooks).
EVENT_KINDS = ("empty_cache", "alloc", "free")
PARAM_HOOKS = ("hook", "hook_keep", "post_accumulate")
EVENT_MAX_ELEMENTS = 2**22


# Characters a terminal acts on instead of showing: C0 (ESC, BEL, CR, backspace),
# DEL, C1 (CSI 0x9b among them), the line and paragraph separators, and the
# bidirectional overrides and isolates that reorder the text shown around them.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_CONTROL_BUT_LAYOUT = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: str, layout: bool = False) -> str:
    """``text`` with every control character written as its Python escape
    (``\\x1b``, ``\\r``, ``\\u202e``), other text as it is.

    Keys, titles and file names come from strangers' files, and a message or
    report that echoes them raw lets the file clear the reader's screen, set
    the terminal's title, or overwrite the line it is on (``\\r``). Escaping
    is idempotent (an escape is printable), so text may pass here more than
    once. ``layout`` keeps newline and tab, for text of several lines."""
    return (_CONTROL_BUT_LAYOUT if layout else CONTROL).sub(_escape, text)


def _escape(m: re.Match[str]) -> str:
    return m.group().encode("unicode_escape").decode("ascii")


class SpecError(ValueError):
    """A case that cannot be built; the message names the field.

    The message is made printable here, once for every message about a
    file's content: the field's path holds the file's own keys."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{printable(where)}: {printable(message)}")
        self.where = where
