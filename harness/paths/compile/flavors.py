"""What each compile path compiles with, and what the paths promise."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from harness.generate import PLACEMENTS
from harness.observation import LIFETIME, RECOMPUTATION
from harness.paths.base import PLAIN_GRADS, RNG_NOT_COMPARED, Contract
from harness.paths.compile.data import INDUCTOR_SLOTS, JUDGEABLE, SLOTS, ops_draw

# The compile paths promise everything eager does (retained grads too), and
# want parameter hooks (drawn with the lifetime schedules) and training steps
# (clip and optimizer, drawn with the DTensor flag; the placements it also
# draws are ignored here), and the model parts (dropout included: see
# ``CompilePath.config`` and ``structure_key``), with OpInfo ops placed among
# them by the family's own draw (``data``; each flavour its own picks, see
# ``data.salt_of``), a float64 structure then kept
# within what its term bounds can judge (``judgeable``). A drawn structure is checked
# with ``DATA_VARIANTS`` data (``Contract.data_variants``): a compile costs 0.3
# to 2 s, a case on a compiled structure 10 to 20 ms.
DATA_VARIANTS = 16
CONTRACT = Contract(retained_grads=True, lifetime_schedules=True, draws=(PLACEMENTS, JUDGEABLE), model_parts=True,
                    data_variants=DATA_VARIANTS, blind=(
    PLAIN_GRADS, RNG_NOT_COMPARED,
    (RECOMPUTATION, "what a compiled graph recomputes is the partitioner's choice (AOTAutograd's min-cut partitioner "
                    "recomputes cheap ops by design), not a count the user can see"),
    (LIFETIME, "not watched: graph_freed is off for the compile family")))
# Off the CPU every OpInfo node is refused (``engine_rules.off_its_devices``):
# a CUDA flavour draws no dense ops, which it would only throw away.
DEVICE_CONTRACT = replace(CONTRACT, draws=(PLACEMENTS,))


@lru_cache(maxsize=None)
def cpu_contract(flavour: str, backend: str) -> Contract:
    """``CONTRACT`` with the flavour's dense ops drawn first. Inductor pays
    seconds per OpInfo op (``data.INDUCTOR_SLOTS``): its flavours draw fewer."""
    slots = INDUCTOR_SLOTS if backend == "inductor" else SLOTS
    return replace(CONTRACT, draws=(ops_draw(flavour, slots),) + CONTRACT.draws)


@dataclass(frozen=True)
class Flavor:
    """One way of compiling: what ``torch.compile`` gets and where it is used."""

    name: str
    backend: str = "inductor"
    dynamic: bool | None = False
    compiled_autograd: bool = False
    compile_forward: bool = True
    other_size_first: bool = False  # warm up at another batch size (the dynamic paths)
    device: str = "cpu"
    # Its seconds per structure against the other flavours', a small int (0 the
    # cheapest): the heaviest flavours start first (``harness.paths.heaviness``),
    # so no worker is left with two of them at the end. docs/benchmarks.md has
    # the seconds measured, cold and warm.
    cost: int = 0

    @property
    def contract(self) -> Contract:
        return DEVICE_CONTRACT if self.device != "cpu" else cpu_contract(self.name, self.backend)

    def describe(self) -> str:
        what = f'torch.compile(backend="{self.backend}", dynamic={self.dynamic})'
        if self.compiled_autograd:
            what += " with compiled autograd" + ("" if self.compile_forward else " (eager forward)")
        if self.other_size_first:
            what += ", first run at another batch size"
        return f"{what} on {self.device}"


FLAVORS = {
    "compile.aot_eager": Flavor("compile.aot_eager", backend="aot_eager"),
    "compile.inductor": Flavor("compile.inductor", backend="inductor", cost=3),
    "compile.autograd": Flavor("compile.autograd", backend="aot_eager", compiled_autograd=True, cost=4),
    "compile.autograd.eager_forward": Flavor("compile.autograd.eager_forward", backend="aot_eager",
                                             compiled_autograd=True, compile_forward=False, cost=2),
    "compile.dynamic.symbolic": Flavor("compile.dynamic.symbolic", backend="inductor", dynamic=True,
                                       other_size_first=True, cost=5),
    "compile.dynamic.recompile": Flavor("compile.dynamic.recompile", backend="inductor", dynamic=False,
                                        other_size_first=True, cost=1),
    "compile.inductor.cuda": Flavor("compile.inductor.cuda", backend="inductor", device="cuda"),
}
