"""Deliberately broken pipeline stages: the pipeline paths must catch each.

``PreClamp`` is torch's own ``PipelineStage`` with the founding bug put
back into its split backward (torch before 2.13: a weight nested on one
path counted once per captured intermediate), judged against
``pipeline.<schedule>.stock``; it ships for ``gradfuzz selfcheck``. The
others are ``oracles.pipeline_fixed.FixedPipelineStage`` with one bug put
back, so a divergence can only come from that bug. Ranks import them by
name (``harness.paths.pipeline.canaries:DoubleWeight``), as a user's own stage.
"""

from __future__ import annotations

from typing import Any

import torch

from torch.distributed.pipelining import PipelineStage

from harness.paths.family import Canary
from oracles.pipeline_fixed import FixedPipelineStage


class PreClamp(PipelineStage):
    """Stock ``PipelineStage`` whose input/weight split is
    ``harness.paths.injected.double_count_nested`` (pre-2.13 behaviour)."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        from harness.paths.injected import double_count_nested as split

        if backward_type == "input":
            return split.stage_backward_input(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                              bwd_kwargs["input_values"], self.submod.parameters())
        if backward_type == "weight":
            return split.stage_backward_weight(self.submod.parameters(), bwd_kwargs["param_groups"]), None
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


class DoubleWeight(FixedPipelineStage):
    """The weight pass adds each weight grad twice (the founding double count,
    for every weight of a split stage)."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if backward_type == "weight":
            groups = bwd_kwargs["param_groups"]
            for g in groups:
                g["grads"] = [2 * x for x in g["grads"]]
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


class Overwrite(FixedPipelineStage):
    """Each microbatch's weight grads replace ``.grad`` instead of adding to it:
    earlier microbatches (and earlier steps under zero_grad "keep") are lost."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        for p in self.submod.parameters():
            p.grad = None
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


class NoInputGrad(FixedPipelineStage):
    """A non-first stage hands back zero input grads: every earlier stage
    trains on nothing."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        grads, groups = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type in ("full", "input") and not self.is_first:
            grads = tuple(None if g is None else torch.zeros_like(g) for g in grads)
        return grads, groups


CANARIES = {
    "pre_clamp": "harness.paths.pipeline.canaries:PreClamp",
    "double_weight": "harness.paths.pipeline.canaries:DoubleWeight",
    "overwrite": "harness.paths.pipeline.canaries:Overwrite",
    "no_input_grad": "harness.paths.pipeline.canaries:NoInputGrad",
}


def canaries() -> list[Canary]:
    """The founding nested-weight double count put back into the stock
    stage's split backward, through the zero-bubble V schedule on one rank,
    judged against stock. Before torch 2.13 that bug is stock's own, so the
    double count goes into the fixed stage instead (``DoubleWeight``, judged
    against the fixed path); where one rank cannot hold adjacent stages, the
    interleaved zero-bubble schedule on two ranks carries each."""
    from harness.paths.pipeline.paths import PipelinePath
    from harness.paths.pipeline.rank import discover

    found = discover()

    def canary(name: str, impl: str, schedule: str, ranks: int, base: str, fallback: Canary | None) -> Canary:
        return Canary(name, lambda: PipelinePath(schedule, CANARIES[impl], ranks, name=f"canary.{name}"), base,
                      needs_clamp=impl == "pre_clamp", fallback=fallback)

    fixed2 = stock2 = None
    if "InterleavedZeroBubble" in found:
        fixed2 = canary("pipeline_double_weight_ranks2", "double_weight", "InterleavedZeroBubble", 2,
                        "pipeline.InterleavedZeroBubble.ranks2.fixed", None)
        stock2 = canary("pipeline_pre_clamp_ranks2", "pre_clamp", "InterleavedZeroBubble", 2,
                        "pipeline.InterleavedZeroBubble.ranks2.stock", fixed2)
    if "ZBVZeroBubble" not in found:
        return [stock2] if stock2 else []
    # Each runs its fallback where it cannot run (a layout one rank cannot hold) or proves nothing
    # (before 2.13): the V canary over stock, then over the fixed stage, then both on two ranks.
    fixed1 = canary("pipeline_double_weight", "double_weight", "ZBVZeroBubble", 1, "pipeline.ZBVZeroBubble.fixed",
                    stock2 or fixed2)
    return [canary("pipeline_pre_clamp", "pre_clamp", "ZBVZeroBubble", 1, "pipeline.ZBVZeroBubble.stock", fixed1)]
