"""``compile.*``: ``torch.compile`` on the CPU: the paths (``path``) and
their canaries."""

from harness.paths.family import Family, lazy

FAMILY = Family(
    "compile",
    paths=lazy("harness.paths.compile.paths:paths"),
    canaries=lazy("harness.paths.compile.canaries:canaries"),
    docs="harness/paths/compile/README.md",
    prefixes=("compile",),
    components={"compile": "torch.compile"},
    machinery=("torch._functorch.aot_autograd", "torch._functorch._aot_autograd", "torch._functorch.partitioners",
               "torch._dynamo.compiled_autograd", "torch._dynamo.backends.common"),
)
