"""The case a draw is building, and the magnitude budget that keeps exact
mode exact: every block asks ``grows`` before it adds a factor."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.case.spec import Hook, Input, Node, Param, Use

EXACT_BUDGET = 2.0**16  # forward magnitude estimate; grads add batch, microbatch and cotangent factors


@dataclass
class _Builder:
    dim: int
    batch: int
    exact: bool
    params: list[Param] = field(default_factory=list)
    inputs: list[Input] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    hooks: list[Hook] = field(default_factory=list)
    retain: list[str] = field(default_factory=list)
    bound: float = 3.0
    losses: list[str] = field(default_factory=list)  # scalar losses (cross-entropy), extra outputs

    def param(self, shape: tuple[int, ...], slot: int, prefix: str = "w") -> str:
        """Slot picks an existing parameter of this shape (tying) or makes one."""
        same = [p.name for p in self.params if p.shape == shape]
        if slot < len(same):
            return same[slot]
        name = f"{prefix}{len(self.params)}"
        self.params.append(Param(name, shape))
        return name

    def node(self, op: str, *args: Use, **attrs) -> str:
        name = f"n{len(self.nodes)}"
        self.nodes.append(Node(name, op, tuple(args), tuple(sorted(attrs.items()))))
        return name

    def grows(self, factor: float) -> bool:
        """In exact mode, refuse a block that could leave the exact range."""
        if self.exact and self.bound * factor > EXACT_BUDGET:
            return False
        self.bound *= factor
        return True
