"""``split.*``: split backward (``stage_backward_input`` then
``stage_backward_weight``): the path (``path``) and its canaries."""

from harness.paths.family import Family, UserImpl, lazy

FAMILY = Family(
    "split",
    paths=lazy("harness.paths.split.paths:paths"),
    canaries=lazy("harness.paths.split.canaries:canaries"),
    user_impls=(UserImpl("split_impl", "--split-impl", "harness.paths.split.paths:load_impl",
                         "MODULE[:ATTR] with stage_backward_input and stage_backward_weight"),),
    docs="harness/paths/split/README.md",
    prefixes=("split",),
    components={"split": "pipelining"},
    machinery=("torch.distributed.pipelining._backward",),
)
