"""A case spelled out as plain torch source, for the standalone repro scripts.

Every script template (``harness.out.repro``, ``harness.out.pipeline_repro``,
``harness.out.dtensor_repro``) writes the module, its data and its custom
autograd Functions the same way, from typed values only: names are the
validated identifiers of the case, numbers are literals, text goes through
``repr``.
"""

from __future__ import annotations

import inspect
from typing import Any

from harness.case import functions
from harness.case.ops import OPS
from harness.case.spec import Case, SpecError, Use


def checked(case: Case) -> Case:
    """The case as its own JSON would load: every name a validated,
    non-keyword identifier, every number a number of its type, every attribute
    one its op takes. Scripts are generated only from such values (a Case made
    in code, not read from a file, gets the same check here)."""
    return Case.from_json(case.to_json())


def factor_literal(factor: Any) -> str:
    """A hook factor as a literal, after its type check (never pasted text)."""
    if isinstance(factor, bool) or not isinstance(factor, int):
        raise SpecError("hooks.factor", f"expected an integer, got {factor!r}")
    return repr(int(factor))


def _ref(use: Use, nodes: set[str]) -> str:
    s = use.ref if use.ref in nodes else f"v[{use.ref!r}]"
    if use.index is not None:
        s = f"{s}[{use.index}]"
    return f"{s}.mT" if use.transpose else s


def forward_source(case: Case) -> str:
    nodes = {n.name for n in case.nodes}
    hooks = {h.node: h for h in case.hooks}
    lines = ["def forward(v):"]
    if any(OPS[n.op].random for n in case.nodes):  # as Built.seed_rng: every forward draws the same masks
        lines.append(f"    torch.manual_seed({case.seed * 7919 + 77})")
    for n in case.nodes:
        args = [_ref(u, nodes) for u in n.args]
        lines.append(f"    {n.name} = {OPS[n.op].source(args, dict(n.attrs))}")
        h = hooks.get(n.name)
        if h is not None:
            body = f"lambda g: g * {factor_literal(h.factor)}" if h.kind == "scale" else "lambda g: None"
            lines.append(f"    if {n.name}.requires_grad:")
            lines.append(f"        {n.name}.register_hook({body})  # a {h.kind} hook")
        if n.name in case.retain_grad:
            lines.append(f"    if {n.name}.requires_grad:")
            lines.append(f"        {n.name}.retain_grad()")
    outs = ", ".join(_ref(u, nodes) for u in case.outputs)
    lines.append(f"    return [{outs}]")
    return "\n".join(lines)


def literal(t: Any) -> str:
    return repr(t.tolist())


def function_helpers(case: Case) -> list[str]:
    """Source of the custom autograd Functions the case uses."""
    used = {n.op for n in case.nodes}
    return [inspect.getsource(fn) for op, fn in _FUNCTIONS.items() if op in used]


_FUNCTIONS = {"layout_matmul": functions.LayoutMatmul, "pair": functions.Pair, "passthrough": functions.PassThrough}
