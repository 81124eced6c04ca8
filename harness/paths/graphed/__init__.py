"""``graphed.*``: the case's module through a CUDA-graph wrapper: the
paths (``path``) and their canaries."""

from harness.paths.family import Family, UserImpl, lazy

FAMILY = Family(
    "graphed",
    paths=lazy("harness.paths.graphed.paths:paths"),
    canaries=lazy("harness.paths.graphed.canaries:canaries"),
    user_impls=(UserImpl("graphed_impl", "--graphed-impl", "harness.paths.graphed.paths:load_impl",
                         "MODULE:ATTR, a make_graphed_callables-like callable"),),
    docs="harness/paths/graphed/README.md",
    prefixes=("graphed",),
    components={"graphed": "CUDA graphs"},
    machinery=("torch.cuda.graphs",),
)
