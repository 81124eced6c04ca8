"""``twice.halves``: backward twice per microbatch, each at half the grad outputs."""

from __future__ import annotations

import torch

from harness.case.spec import Case
from harness.observation import Observation
from harness.paths import Availability, Contract, Options, Repro, run_schedule
from harness.paths.workarounds import IN_PROCESS

# The body of backward(outs, cots, inputs, params) in the standalone script: the same halves.
BACKWARD = """\
    live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    for keep in (True, False)[:2 if live else 0]:
        torch.autograd.backward([o for o, _ in live], [c * 0.5 for _, c in live], retain_graph=keep)
"""


def halves(times: int):
    """The backward of a loop that calls backward ``times`` of its two halves (2: right; 1: the canary's bug)."""

    def backward(outs, cots, inputs, params):
        live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
        for keep in (True, False)[2 - times if live else 2:]:
            torch.autograd.backward([o for o, _ in live], [c * 0.5 for _, c in live], retain_graph=keep)
        return {n: t.grad for n, t in inputs.items()}

    return backward


class Twice:
    contract = Contract(retained_grads=True, gap_cases=True, model_parts=True, graph_freed=True)
    workarounds = IN_PROCESS

    def __init__(self, name: str = "twice.halves", times: int = 2) -> None:
        self.name, self.times = name, times

    def availability(self) -> Availability:
        return Availability(True, "two half-scale backwards per microbatch")

    def supports(self, case: Case) -> str | None:
        if case.hooks or case.schedule.param_hooks:
            return "hooks fire once per backward call, and this path calls backward twice"
        return None

    def run(self, case: Case) -> Observation:
        return run_schedule(case, self.name, halves(self.times), observe=self.contract.observe())

    def repro(self, case: Case) -> Repro:
        return Repro(backward=BACKWARD)


def paths(_options: Options) -> list[Twice]:
    return [Twice()]
