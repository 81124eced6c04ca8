"""Per-use-site gradient contributions, for explaining divergences.

A weight used at several sites gets the sum of one grad per site. When a
path's grad is wrong, the most useful sentence is often "the use at n0 was
counted twice": that needs each site's contribution on its own, which a
forward with a separate leaf per use gives directly.
"""

from __future__ import annotations

import torch

from harness.materialize.tensors import Built
from harness.case.ops import OPS
from harness.case.spec import Case


def site_contributions(case: Case, k: int) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """For backward ``k``: each parameter's grad split by use site (float64)."""
    built = Built(case)
    params = built.params()
    inputs = {x.name: t.requires_grad_(x.requires_grad) for x, t in zip(case.inputs, built.inputs(k).values())}
    # Every read of a parameter: (owner node or "__out__", operand position, use, label).
    uses = [(n.name, j, u, f"use at {n.name} ({_describe(n)})") for n in case.nodes for j, u in enumerate(n.args)]
    uses += [("__out__", i, u, f"output {i}") for i, u in enumerate(case.outputs)]
    leaves: list[tuple[str, str, torch.Tensor]] = []  # (param, label, leaf)
    env_values = {**params, **inputs}
    patched = []
    for owner, j, u, label in uses:
        if u.ref in params:
            leaf = params[u.ref].detach().clone().requires_grad_()
            name = f"{u.ref}__at_{owner.strip('_')}_{j}"
            env_values[name] = leaf
            leaves.append((u.ref, label, leaf))
            patched.append((owner, j, name))
    if not leaves:
        return {}
    case2 = _rewire(case, patched)
    outs = Built(case2).forward(env_values)
    cots = built.cotangents(k)
    live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    if not live:
        return {}
    grads = torch.autograd.grad([o for o, _ in live], [t for _, _, t in leaves], [c for _, c in live], allow_unused=True)
    found: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for (p, label, leaf), g in zip(leaves, grads):
        found.setdefault(p, []).append((label, torch.zeros_like(leaf) if g is None else g.detach()))
    return found


def _describe(node) -> str:
    args = [u.ref + (".mT" if u.transpose else "") for u in node.args]
    return OPS[node.op].source(args, dict(node.attrs))


def _rewire(case: Case, patched: list[tuple[str, int, str]]) -> Case:
    """The same case with each patched use reading its own leaf by name."""
    import dataclasses

    from harness.case.spec import Param

    by_node: dict[str, dict[int, str]] = {}
    for node, j, name in patched:
        by_node.setdefault(node, {})[j] = name
    nodes = []
    for n in case.nodes:
        repl = by_node.get(n.name, {})
        args = tuple(dataclasses.replace(u, ref=repl[j]) if j in repl else u for j, u in enumerate(n.args))
        nodes.append(dataclasses.replace(n, args=args))
    out_repl = by_node.get("__out__", {})
    outputs = tuple(dataclasses.replace(u, ref=out_repl[i]) if i in out_repl else u for i, u in enumerate(case.outputs))
    shapes = {p.name: p.shape for p in case.params}
    extra = tuple(Param(name, shapes[name.split("__at_")[0]]) for _, _, name in patched)
    return dataclasses.replace(case, params=case.params + extra, nodes=tuple(nodes), outputs=outputs)
