"""``eager.*``: plain ``.backward()`` held to the oracle (``path``)."""

from harness.paths.family import Family, lazy

FAMILY = Family("eager", paths=lazy("harness.paths.eager.paths:paths"), docs="harness/paths/eager/README.md",
                prefixes=("eager",), machinery=("torch.autograd", "torch._tensor"), components={"eager": "autograd"},
                noise_reference="eager.accumulate")
