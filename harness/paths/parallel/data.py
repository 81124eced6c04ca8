"""The data-parallel family's part of a case: the DDP and FSDP2 switches a
user sets, and where FSDP2 units are cut; and its own draws of them, with a
training step (``Contract.draws``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from harness.case import schema as sc
from harness.case.namespace import DataNamespace, check_cuts, cuts
from harness.case.spec import Case
from harness.generate import ONE_IN_EIGHT, Draw, training_steps

# Each option is one switch a DDP or FSDP2 user sets, so a case shrinks by dropping them.
OPTIONS = (
    "no_sync",          # accumulate without synchronising all but each step's last microbatch
    "bucket_view",      # DDP gradient_as_bucket_view=True
    "static_graph",     # DDP static_graph=True
    "find_unused",      # DDP find_unused_parameters=True
    "small_buckets",    # DDP bucket_cap_mb tiny: one parameter per bucket, tied ones apart
    "hook_allreduce",   # DDP comm hook: the built-in allreduce hook (counted)
    "hook_builtin",     # DDP comm hook: the C++ built-in ALLREDUCE
    "keep_unsharded",   # FSDP2 reshard_after_forward=False
    "reshard_int",      # FSDP2 reshard_after_forward=1 (an int: reshard to a smaller world)
    "no_reshard_after_backward",  # FSDP2 set_reshard_after_backward(False) inside no_sync windows
    "units",            # a block per span between ``units`` cuts (FSDP2: a unit each, besides the root)
    "checkpoint",       # each block recomputed in backward (non-reentrant torch.utils.checkpoint); needs units
    "bf16_reduce",      # grads reduced in bfloat16: FSDP2 MixedPrecisionPolicy(reduce_dtype), DDP's bf16 compress hook
)
LOW_PRECISION = {"bf16_reduce": "bfloat16"}  # option -> the type the stock wrapper rounds grads to


@dataclass(frozen=True)
class Switches:
    options: tuple[str, ...] = ()
    units: tuple[int, ...] = ()  # cut positions in ``case.nodes``, with the ``units`` option


def switches(case: Case) -> Switches:
    return case.data("parallel") or Switches()


def _options(v: Any, where: str) -> tuple[str, ...]:
    return tuple(sc.string(x, f"{where}[{i}]", choices=OPTIONS) for i, x in enumerate(sc.array(v, where, len(OPTIONS))))


def _from_legacy(top: dict[str, Any]) -> Switches | None:
    opts = _options(list(top["parallel"]), "parallel")
    return Switches(opts, top["stages"] if "units" in opts else ()) if opts else None


CASE_DATA = DataNamespace("parallel", Switches, {"options": _options, "units": cuts(3)},
                          check=lambda case, v, where: check_cuts(case, v.units, f"{where}.units"),
                          from_legacy=_from_legacy)


@dataclass(frozen=True)
class Machinery:
    """What the torchrun script needs of a path (``Repro.family``): "ddp" or "fsdp2", on how many ranks."""

    kind: str
    world_size: int


@st.composite
def data_parallel(draw, case: Case) -> Case:
    """DDP / FSDP2 switches for one case (``Switches``), each a draw that
    shrinks to "off"; with ``units`` the node list is cut into FSDP2 units
    (``Switches.units``), so a weight used in two units lives in the root, tied
    across them. Then, as for DTensor, maybe a training step."""
    rare = ("bf16_reduce",)  # one case in eight: a low-precision case is compared loosely (compare.values.LOW_EPS)
    common = [o for o in OPTIONS if o not in rare]
    on = draw(st.lists(st.booleans(), min_size=len(common), max_size=len(common)))
    opts = [o for o, b in zip(common, on) if b]
    opts += [o for o in rare if draw(ONE_IN_EIGHT)]
    stages: tuple[int, ...] = ()
    free = list(range(1, len(case.nodes)))
    if "units" in opts and not free:
        opts.remove("units")
    if "units" in opts:
        picks = draw(st.lists(st.integers(0, 255), min_size=1, max_size=min(3, len(free))))
        stages = tuple(sorted({free.pop(r % len(free)) for r in picks if free}))
        if not stages:
            opts.remove("units")
    if "checkpoint" in opts and "units" not in opts:
        opts.remove("checkpoint")  # recomputation is per block
    case = case.with_data("parallel", Switches(tuple(opts), stages) if opts else None)
    return draw(training_steps(case))

SWITCHES = Draw("parallel", (data_parallel,))
