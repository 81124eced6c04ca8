"""Canaries: deliberately wrong implementations the harness must catch.

They ship with the package because ``gradfuzz selfcheck`` (and ``gate``,
which runs it first) proves on the user's own installation that detection
still works: a gate that silently lost its teeth after an upgrade must not
pass. Each family brings its own (``Family.canaries``, in its folder's
``canaries`` module); a canary is judged relative to its base
path, so what is caught is the injected bug, not another bug the base has.
"""

from __future__ import annotations

from harness.engine.coverage import machinery_family
from harness.paths import families, resolve
from harness.paths.family import Canary

__all__ = ["Canary", "all_canaries", "resolve_base", "select"]


def resolve_base(canary: Canary) -> tuple[object, str]:
    """The base path to judge ``canary`` against (the canary without its
    injection; None: none) and why the canary cannot run here ("" if it can)."""
    why = canary.proves_nothing_here()
    if why or not canary.base:
        return None, why
    base = resolve(canary.base)[0]
    available = base.availability()
    return base, "" if available.ok else f"base {canary.base} unavailable: {available.reason}"


def all_canaries() -> list[Canary]:
    """Every registered family's canaries, in registration order."""
    return [c for f in families() for c in f.canaries()]


def for_paths(names: list[str]) -> list[Canary]:
    """The canaries of the families that make any of the paths ``names``
    (``gate --paths split`` checks split's teeth, not DeepSpeed's)."""
    chosen = {machinery_family(n) for n in names}
    return [c for f in families() if f.name in chosen for c in f.canaries()]


def select(names: str | None) -> list[Canary] | None:
    """``--canaries a,b``: those canaries in the order given (None: all)."""
    if not names:
        return None
    from harness.paths import UsageError

    known = {c.name: c for c in all_canaries()}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        raise UsageError(f"--canaries {names}: unknown canary {', '.join(unknown) or '(none named)'}; "
                         f"expected some of {', '.join(known)}")
    return [known[n] for n in wanted]
