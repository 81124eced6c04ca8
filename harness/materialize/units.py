"""A case as an ``nn.Module`` for wrappers that take modules (DDP, FSDP2).

Data-parallel wrappers own parameters through the modules that register
them: DDP buckets a module's parameters, and ``fully_shard`` makes a unit of
a module and its parameters. So a case becomes a root module; with unit
cuts (the ``units`` argument: the data-parallel family's unit cuts) each span of nodes is
a ``Block`` submodule holding the parameters only it uses, and a parameter
used in two blocks (a tied weight) is the root's, as FSDP users tie them.
With ``recompute`` each block is an activation-checkpointed region
(non-reentrant ``torch.utils.checkpoint``), as large runs combine them.

Parameters are registered under ``names.attribute(name)``, never the case's
name itself, which may be ``cuda`` or ``training``. Every forward reads parameters by name through ``weight(name)`` at the
moment of use, because FSDP2 swaps its sharded parameters for unsharded
ones around each unit's forward; ``weights=`` hands the whole forward other
tensors instead (a reference implementation's gathered parameters).
"""

from __future__ import annotations

from typing import Any

import torch

from harness.materialize.names import attribute
from harness.materialize.stages import bounds
from harness.materialize.tensors import Built


def _owners(built: Built, units: tuple[int, ...]) -> dict[str, int]:
    """Each parameter's owner: the index of the only block that uses it, or -1 (the root)."""
    case = built.case
    if not units:
        return {p.name: -1 for p in case.params}
    spans = bounds(case, units)
    used: dict[str, set[int]] = {p.name: set() for p in case.params}
    for j, (a, b) in enumerate(spans):
        for node in case.nodes[a:b]:
            for u in node.args:
                if u.ref in used:
                    used[u.ref].add(j)
    for u in case.outputs:
        if u.ref in used:
            used[u.ref].add(-1)
    return {n: next(iter(s)) if len(s) == 1 else -1 for n, s in used.items()}


class Block(torch.nn.Module):
    """One span of the case's nodes with the parameters only it uses."""

    def __init__(self, built: Built, span: tuple[int, int], root: "CaseModule", recompute: bool = False) -> None:
        super().__init__()
        self.built = built
        self.span = span
        self.recompute = recompute
        self.ran = False  # in this forward: a second run is checkpoint's recomputation
        self._root = [root]  # a list: not registered as a submodule (no cycle in the module tree)

    def forward(self, env: dict[str, Any]) -> dict[str, Any]:
        # The weights are read here, outside any recomputation: a
        # recomputation must see the tensors this forward used.
        env = {**env, **{n: self._root[0].weight(n) for n in self._root[0].owned_by(self)}}
        if self.recompute and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._run, env, use_reentrant=False)
        return self._run(env)

    def _run(self, env: dict[str, Any]) -> dict[str, Any]:
        env = dict(env)
        self.built.run_span(env, *self.span, install=not self.ran)
        self.ran = True
        # Only this span's results: what a block hands on (FSDP2 hooks every
        # tensor a unit returns, and the root's weights are not this unit's).
        return {n.name: env[n.name] for n in self.built.case.nodes[self.span[0]:self.span[1]]}


class CaseModule(torch.nn.Module):
    """The case's forward over its own parameters: ``forward(*inputs)`` (in
    the case's input order) returns the outputs as a tuple."""

    def __init__(self, built: Built, values: dict[str, torch.Tensor], device: Any, dtype: torch.dtype,
                 units: tuple[int, ...] = (), recompute: bool = False) -> None:
        super().__init__()
        self.built = built
        case = built.case
        self.owner = _owners(built, units)
        self.blocks = torch.nn.ModuleList(
            [Block(built, span, self, recompute) for span in bounds(case, units)] if units else [])
        for p in case.params:
            holder = self if self.owner[p.name] < 0 else self.blocks[self.owner[p.name]]
            holder.register_parameter(attribute(p.name), torch.nn.Parameter(values[p.name].to(device, dtype),
                                                                 requires_grad=p.requires_grad))
        self.override: dict[str, torch.Tensor] | None = None

    def holder(self, name: str) -> torch.nn.Module:
        return self if self.owner[name] < 0 else self.blocks[self.owner[name]]

    def weight(self, name: str) -> torch.Tensor:
        if self.override is not None:
            return self.override[name]
        return getattr(self.holder(name), attribute(name))

    def owned_by(self, block: Block) -> list[str]:
        return [n for n, j in self.owner.items() if j >= 0 and self.blocks[j] is block]

    def params(self) -> dict[str, torch.Tensor]:
        """The registered parameters by case name (sharded ones, under FSDP2)."""
        return {p.name: getattr(self.holder(p.name), attribute(p.name)) for p in self.built.case.params}

    def forward(self, *inputs: torch.Tensor, weights: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        case = self.built.case
        self.override = weights
        try:
            env: dict[str, Any] = {x.name: t for x, t in zip(case.inputs, inputs)}
            env.update({n: self.weight(n) for n, j in self.owner.items() if j < 0})
            self.built.retained = {}
            self.built.seed_rng()
            if len(self.blocks):
                for block in self.blocks:
                    block.ran = False
                for block in self.blocks:
                    env.update(block(env))
            else:
                self.built.run_span(env, 0, len(case.nodes))
            return tuple(self.built.outputs_of(env))
        finally:
            self.override = None
