"""The DeepSpeed family's canaries: a training loop that keeps only the last
micro-step of each accumulation window (it clears .grad before every other
backward), judged against ZeRO stage 0 as installed; and, with fp16, a loop
that raises the loss scale inside a window (a scaler updated per micro-step,
not per step), judged against ZeRO stage 1 with fp16."""

from __future__ import annotations

from typing import Any

from harness.paths.family import Canary


class keeps_last_micro_step:
    @staticmethod
    def before_backward(engine: Any, micro: int) -> None:
        if micro:
            for p in engine.module.parameters():
                p.grad = None


class raises_scale_mid_window:
    @staticmethod
    def before_backward(engine: Any, micro: int) -> None:
        if micro:  # the micro-steps before were scaled by half of what the step divides by
            engine.optimizer.loss_scale = engine.optimizer.loss_scale * 2


def canaries() -> list[Canary]:
    from harness.paths.deepspeed.paths import DeepSpeedPath, Fp16Path

    return [Canary("deepspeed_keeps_last_micro_step",
                   lambda: DeepSpeedPath("canary.deepspeed_keeps_last_micro_step", 0,
                                         "harness.paths.deepspeed.canaries:keeps_last_micro_step", timeout=60.0),
                   "deepspeed.zero0.stock", budget=100),
            Canary("deepspeed_fp16_raises_scale_mid_window",
                   lambda: Fp16Path("canary.deepspeed_fp16_raises_scale_mid_window", 1,
                                    "harness.paths.deepspeed.canaries:raises_scale_mid_window", timeout=60.0,
                                    backend="nccl"),
                   "deepspeed.zero1.fp16", budget=100)]
