"""Where a case's names meet torch's attribute namespaces.

A case may name a parameter anything the schema allows, and ``cuda``,
``training`` or ``override`` are allowed. A module registers parameters and
submodules as attributes, beside its own methods and those of any wrapper
that later takes it over (DDP's, FSDP2's class swap, ``parallelize_module``),
so a case name used as the attribute itself collides with them, and the
path fails where eager autograd did not: a false finding. Every attribute
that holds a case's value is therefore ``attribute(name)``, a prefix no
torch module class uses (``tests/cover/test_names.py`` checks the classes a
case is wrapped in), and case names come back with ``case_name``.
"""

from __future__ import annotations

PREFIX = "p_"


def attribute(name: str) -> str:
    """The attribute a module holds the case's ``name`` under."""
    return PREFIX + name


def variable(name: str) -> str:
    """The variable a generated repro script holds the case's node ``name`` in.

    A script binds names of its own inside the functions that spell the case
    out (``PassThrough``, ``torch``, a stage's arguments ``a0``, ``a1``): a
    node assigned under such a name shadows it for the whole function, and
    the script fails or computes something else. Scripts bind no name with
    the prefix, so the prefixed name is the node's alone."""
    return attribute(name)


def case_name(qualified: str) -> str:
    """The case's name of a parameter from its qualified name (``blocks.0.p_w1`` -> ``w1``)."""
    last = qualified.rsplit(".", 1)[-1]
    if not last.startswith(PREFIX):
        raise KeyError(f"{qualified!r} is not a case parameter's attribute")
    return last[len(PREFIX):]
