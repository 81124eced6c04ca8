"""A path family: the unit people extend gradfuzz by, and the unit its code is organised by.

A family is one folder (``harness/paths/<family>/`` for the built-in ones,
any package for a third party) whose ``__init__`` holds one ``Family``
value. The core asks families for their paths, canaries, standalone-script
templates and user flags; it never names one. Every field but ``name`` and
``paths`` is optional, so a family starts as small as one path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from packaging.version import Version

if TYPE_CHECKING:
    from harness.case.spec import Case
    from harness.paths.base import Options, Path, Repro

# template name -> writer(case, machinery, title) -> the script's text
ScriptWriter = Callable[["Case", "Repro", str], str]


@dataclass(frozen=True)
class UserImpl:
    """A flag that points one of the family's paths at the user's own code
    (``--split-impl``): checked before any path is built, so a typo is an
    error (exit 2) and never a path silently turned unavailable."""

    option: str  # the ``Options`` field
    flag: str
    loader: str  # MODULE:ATTR of a callable that imports and checks the value (raises LoadError)
    wants: str  # what the flag must name, for the message


@dataclass(frozen=True)
class Canary:
    """A broken path, the path it is judged against, and a detection budget."""

    name: str
    make: Callable[[], Any]
    base: str | None
    budget: int = 300
    # The injected bug is the installed stock's own before torch 2.13 (the
    # founding nested double count): there, removing the injection removes
    # nothing, so the canary proves nothing and its ``fallback`` runs instead.
    needs_clamp: bool = False
    # The finding kinds the injected bug produces. A canary is caught only by
    # a finding of these kinds on a case where its base agrees (the injection
    # removed, the finding goes away); anything else it shows (an exception
    # from its own code on this torch, say) means the canary is broken.
    expects: tuple[str, ...] = ("value",)
    # Run instead when this canary cannot run here (a layout this torch lacks).
    fallback: "Canary | None" = None

    def proves_nothing_here(self) -> str:
        """Why this canary cannot be causal on the installed torch ("" if it can)."""
        if self.needs_clamp and Version(torch.__version__.split("+")[0]) < Version("2.13"):
            return (f"its injected bug is {self.base}'s own before torch 2.13 (the nested double count): "
                    "with the injection removed the bug stays, so a finding could not be told from it")
        return ""


def _none() -> list:
    return []


def _no_probe_data(cut: bool) -> None:
    return None


@dataclass(frozen=True)
class Family:
    """Everything of one family the core may ask for.

    ``paths(options)`` builds its paths; ``canaries()`` its deliberately
    broken ones, which ``selfcheck`` (and so every gate) must catch;
    ``scripts`` maps each ``Repro.template`` the family's paths return to the
    writer of that standalone script; ``user_impls`` are its flags that name
    user code; ``docs`` is its page, for ``gradfuzz paths``. The last four
    fields are what the core would otherwise keep in tables by family name:
    ``machinery``, ``probe_data``, ``unprobed`` and ``components``.
    """

    name: str
    paths: Callable[["Options"], "list[Path]"]
    canaries: Callable[[], list[Canary]] = _none
    scripts: dict[str, ScriptWriter] = field(default_factory=dict)
    user_impls: tuple[UserImpl, ...] = ()
    case_data: Any = None
    docs: str = ""
    # The distribution of a third-party stack the family tests ("deepspeed"):
    # its installed release is part of every verdict (ledger ranges, reports).
    package: str = ""
    # The first part of every path name the family makes (``("ddp", "fsdp2")``
    # for ``parallel``): ``--paths split.fixed`` then builds only the families
    # it can name, not a pipeline pool. Empty: not declared, always built.
    prefixes: tuple[str, ...] = ()
    # The modules whose code its paths exercise (a package: every file under
    # it), not the harness around them: what ``--coverage`` counts the
    # family's lines of. Empty: the family's runs are not traced.
    machinery: tuple[str, ...] = ()
    # Its part of the observation probe's case (``harness.engine.probe``) as
    # ``case.family.NAME`` holds it in JSON, given whether that case is cut
    # into pipeline stages; None where its paths need none to take the case.
    probe_data: Callable[[bool], Any] = _no_probe_data
    # Its path classes (by class name) the probe cannot speak for, and why:
    # they run cases of their own draws, so a probe case shows nothing of them.
    unprobed: dict[str, str] = field(default_factory=dict)
    # The upstream component each first part of its path names reaches, as an
    # issue title names it (``{"ddp": "DDP", "fsdp2": "FSDP2"}``): what
    # ``gradfuzz report`` puts in brackets. A head it leaves out is its own.
    components: dict[str, str] = field(default_factory=dict)
    # Its path that runs a case as plain eager autograd in the case's own
    # dtype: the float32 noise every check's tolerance caps a path's
    # difference by (``harness.engine.check``). One family declares it.
    noise_reference: str = ""


def lazy(ref: str) -> Callable[..., Any]:
    """``MODULE:ATTR`` as a callable that imports it when first called, so
    that listing a family costs nothing and a family whose machinery this
    torch lacks fails where it is used, reported as unavailable."""

    def call(*args: Any, **kwargs: Any) -> Any:
        import importlib

        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    call.__qualname__ = ref
    return call
