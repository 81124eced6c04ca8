"""Where gradfuzz's own data lives: the project it is installed from.

The known-bug ledger and the regression corpus ship beside the ``harness``
package, in ``<project>/cases``. Read relative to the working directory, a
run started anywhere but the repository root silently lost its ledger (every
known bug read "not in ledger") and its corpus, so every front asks here,
and a file that cannot be found is a setup error (exit 2) naming what was
looked for and the flag that fixes it, never an empty ledger.
"""

from __future__ import annotations

import os

import harness
from harness.paths.base import UsageError

# The project root is the parent of the ``harness`` package directory.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(harness.__file__)))
CORPUS = os.path.join(ROOT, "cases")
LEDGER = os.path.join(CORPUS, "ledger.json")


def ledger_file(given: str | None = None, flag: str = "--ledger") -> str:
    """The ledger to read: ``given`` when the user named one (it must exist),
    else the installed project's ``cases/ledger.json`` (it must exist too)."""
    if given is not None:
        if not os.path.isfile(given):
            what = "not a file" if os.path.exists(given) else "no such file"
            raise UsageError(f"{flag} {given}: {what} ({os.path.abspath(given)}); "
                             f"name an existing ledger, or leave {flag} out to use gradfuzz's own ({LEDGER})")
        return given
    if not os.path.isfile(LEDGER):
        raise UsageError(f"no known-bug ledger: looked for {LEDGER} (cases/ledger.json of the gradfuzz project "
                         f"installed at {ROOT}) and it is not there; pass {flag} FILE, or install gradfuzz from a "
                         "checkout (pip install -e .) so that its cases/ ship with it")
    return _shown(LEDGER)


def corpus_dirs(given: list[str] | None = None, fix: str = "pass --corpus DIR") -> list[str]:
    """The corpus to replay: ``given`` when the user said (``[]``: none),
    else the installed project's ``cases/`` (which must exist)."""
    if given is not None:
        return list(given)
    if not os.path.isdir(CORPUS):
        raise UsageError(f"no regression corpus: looked for {CORPUS} (cases/ of the gradfuzz project installed "
                         f"at {ROOT}) and it is not there; {fix}, or install gradfuzz from a checkout (pip install -e .)")
    return [_shown(CORPUS)]


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (run
    from the checkout: ``cases/...`` as before, so reports and corpus file
    names carry no machine's absolute path), else absolute."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    return path if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel
