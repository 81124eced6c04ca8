"""The torchtitan family's canary: a training loop that keeps only the last
micro-step of each accumulation window (it drops every sharded grad before
each backward but a window's first), judged against ``torchtitan.fsdp.stock``."""

from __future__ import annotations

from typing import Any

from harness.paths.family import Canary


class keeps_last_micro_step:
    @staticmethod
    def before_backward(params: dict[str, Any], micro: int) -> None:
        if micro:
            for p in params.values():
                p.grad = None


def canaries() -> list[Canary]:
    from harness.paths.torchtitan.path import TorchtitanPath

    return [Canary("torchtitan_keeps_last_micro_step",
                   lambda: TorchtitanPath("canary.torchtitan_keeps_last_micro_step", "none", False,
                                          "harness.paths.torchtitan.canaries:keeps_last_micro_step", timeout=60.0),
                   "torchtitan.fsdp.stock", budget=100)]
