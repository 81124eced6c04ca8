"""``dtensor.*``: parameters as DTensors on a real process group: the path
(``path``), what each rank runs (``rank``), collective counting
(``collectives``), the canaries and the torchrun repro script (``script``)."""

from harness.paths.family import Family, UserImpl, lazy

FAMILY = Family(
    "dtensor",
    paths=lazy("harness.paths.dtensor.paths:paths"),
    canaries=lazy("harness.paths.dtensor.canaries:canaries"),
    scripts={"torchrun": lazy("harness.paths.dtensor.script:script")},
    user_impls=(UserImpl("dtensor_impl", "--dtensor-impl", "harness.paths.dtensor.rank:load_impl",
                         "MODULE[:ATTR] with install(params, mesh)"),),
    docs="harness/paths/dtensor/README.md",
    prefixes=("dtensor",),
    components={"dtensor": "DTensor"},
    machinery=("torch.distributed.tensor",),
)
