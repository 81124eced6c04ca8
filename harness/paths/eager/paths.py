"""``eager.accumulate``: plain ``.backward()`` accumulating into ``.grad``.

Eager autograd is machinery too: AccumulateGrad steals incoming buffers,
fixes up layouts and sums in place. This path holds it to the oracle.
"""

from __future__ import annotations

import torch

from harness.paths.workarounds import IN_PROCESS
from harness.observation import Grads, Observation
from harness.materialize.schedule import run_schedule
from harness.paths.base import (NO_RECOMPUTATION, PLAIN_GRADS, Availability, Contract, Options,
                                Repro)
from harness.case.spec import Case


def _backward(outs, cots, inputs, params) -> Grads:
    live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    if live:
        torch.autograd.backward([o for o, _ in live], [c for _, c in live])
    return {n: t.grad for n, t in inputs.items()}


class EagerAccumulate:
    name = "eager.accumulate"
    contract = Contract(retained_grads=True, gap_cases=True, graph_freed=True, model_parts=True,
                        blind=(NO_RECOMPUTATION, PLAIN_GRADS))
    workarounds = IN_PROCESS

    def availability(self) -> Availability:
        return Availability(True)

    def supports(self, case: Case) -> str | None:
        return None

    def run(self, case: Case) -> Observation:
        return run_schedule(case, self.name, _backward, observe=self.contract.observe())

    def repro(self, case: Case) -> Repro:
        return Repro(backward=(
            "    live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]\n"
            "    if live:\n"
            "        torch.autograd.backward([o for o, _ in live], [c for _, c in live])\n"
        ))


def paths(_options: Options) -> list[EagerAccumulate]:
    return [EagerAccumulate()]
