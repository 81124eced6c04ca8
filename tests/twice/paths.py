"""``twice.halves``: backward once per part of the loss (the case's ``twice``
data: 2 or 4 parts), each with that share of the grad outputs."""

from __future__ import annotations

import torch

from harness.case.spec import Case
from harness.observation import Observation
from harness.paths import Availability, Contract, Options, Repro, run_schedule
from harness.paths.workarounds import IN_PROCESS
from tests.twice.data import PARTS_DRAW, parts_of

# The body of backward(outs, cots, inputs, params) in the standalone script: the same parts.
BACKWARD = """\
    live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    for i in range(PARTS if live else 0):
        torch.autograd.backward([o for o, _ in live], [c / PARTS for _, c in live], retain_graph=i < PARTS - 1)
"""


def parts(n: int, run: int):
    """The backward of a loop that splits its loss into ``n`` parts and runs
    ``run`` of them (all: right; fewer: the canary's bug)."""

    def backward(outs, cots, inputs, params):
        live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
        for i in range(run if live else 0):
            torch.autograd.backward([o for o, _ in live], [c / n for _, c in live], retain_graph=i < run - 1)
        return {n_: t.grad for n_, t in inputs.items()}

    return backward


class Twice:
    # Built on plain autograd: what eager.accumulate shows too (its AccumulateGrad bugs) is not the loop's.
    contract = Contract(retained_grads=True, gap_cases=True, model_parts=True, graph_freed=True, draws=(PARTS_DRAW,),
                        judged_against="eager.accumulate")
    workarounds = IN_PROCESS

    def __init__(self, name: str = "twice.halves", forget: int = 0) -> None:
        self.name, self.forget = name, forget  # forget: parts the loop never runs (the canary's bug)

    def availability(self) -> Availability:
        return Availability(True, "one backward per part of the loss, each with its share of the grad outputs")

    def supports(self, case: Case) -> str | None:
        if case.hooks or case.schedule.param_hooks:
            return "hooks fire once per backward call, and this path calls backward twice"
        return None

    def run(self, case: Case) -> Observation:
        n = parts_of(case)
        return run_schedule(case, self.name, parts(n, n - self.forget), observe=self.contract.observe())

    def repro(self, case: Case) -> Repro:
        return Repro(backward=f"    PARTS = {parts_of(case)}\n" + BACKWARD)


def paths(_options: Options) -> list[Twice]:
    return [Twice()]
