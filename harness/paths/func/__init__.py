"""``func.*``: torch.func's transforms (grad, vjp, vmap) as the machinery that
computes each microbatch's grads (``path``), their eager twin, and canaries."""

from harness.paths.family import Family, lazy

FAMILY = Family(
    "func",
    paths=lazy("harness.paths.func.paths:paths"),
    canaries=lazy("harness.paths.func.canaries:canaries"),
    docs="harness/paths/func/README.md",
    prefixes=("func",),
    components={"func": "torch.func"},
)
