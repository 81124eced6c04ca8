"""The DeepSpeed family's canary: a training loop that keeps only the last
micro-step of each accumulation window (it clears .grad before every other
backward), judged against ZeRO stage 0 as installed."""

from __future__ import annotations

from typing import Any

from harness.paths.family import Canary


class keeps_last_micro_step:
    @staticmethod
    def before_backward(engine: Any, micro: int) -> None:
        if micro:
            for p in engine.module.parameters():
                p.grad = None


def canaries() -> list[Canary]:
    from harness.paths.deepspeed.paths import DeepSpeedPath

    return [Canary("deepspeed_keeps_last_micro_step",
                   lambda: DeepSpeedPath("canary.deepspeed_keeps_last_micro_step", 0,
                                         "harness.paths.deepspeed.canaries:keeps_last_micro_step", timeout=60.0),
                   "deepspeed.zero0.stock", budget=100)]
