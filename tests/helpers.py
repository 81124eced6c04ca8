"""Small builders shared by the tests."""

from __future__ import annotations

from harness.case.spec import Case, Input, Node, Param, Schedule, Use


def nested(microbatches: int = 1, grad_init: str = "none") -> Case:
    """The founding split-backward case: one weight nested on one path, x @ w @ w."""
    return Case(
        params=(Param("w0", (3, 3)),),
        inputs=(Input("x0", (2, 3), requires_grad=True),),
        nodes=(
            Node("n0", "matmul", (Use("x0"), Use("w0"))),
            Node("n1", "matmul", (Use("n0"), Use("w0"))),
        ),
        outputs=(Use("n1"),),
        schedule=Schedule(microbatches=microbatches, grad_init=grad_init),
    )
