"""The torchtitan family's canaries: a training loop that keeps only the last
micro-step of each accumulation window (it drops every sharded grad before
each backward but a window's first), judged against ``torchtitan.fsdp.stock``;
and a TP plan whose transformer-block norms forget to all-reduce their
weight's grad over the sequence-parallel ranks, judged against
``torchtitan.tp.stock``."""

from __future__ import annotations

from typing import Any

from harness.paths.family import Canary


class keeps_last_micro_step:
    @staticmethod
    def before_backward(params: dict[str, Any], micro: int) -> None:
        if micro:
            for p in params.values():
                p.grad = None


class norm_grad_not_all_reduced:
    """After torchtitan's plan is applied, each block norm computes on its local
    sequence shard with its weight's local tensor: ``to_local()`` hands the
    grad back as the weight's (Replicate) placement with no reduction, so
    each rank keeps only its own tokens' share, the classic sequence-parallel
    norm bug (Megatron all-reduces these grads by hand). With SP off the
    input is replicated and every rank's share is the whole: nothing to catch."""

    @staticmethod
    def after_parallelize(model: Any, knobs: Any) -> None:
        import torch
        from torch.distributed.tensor import DTensor

        for block in model.layers.values():
            for norm in (block.attention_norm, block.ffn_norm):
                planned = norm.forward

                def forward(x: Any, norm: Any = norm, planned: Any = planned) -> Any:
                    w = norm.weight
                    if not (isinstance(x, DTensor) and isinstance(w, DTensor)):
                        return planned(x)
                    out = torch.nn.functional.rms_norm(x.to_local(), (x.shape[-1],), w.to_local(), norm.eps)
                    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)

                norm.forward = forward


def canaries() -> list[Canary]:
    from harness.paths.torchtitan.paths import TorchtitanPath
    from harness.paths.torchtitan.tp.paths import TorchtitanTPPath

    return [Canary("torchtitan_tp_norm_grad_not_all_reduced",
                   lambda: TorchtitanTPPath("canary.torchtitan_tp_norm_grad_not_all_reduced",
                                            "harness.paths.torchtitan.canaries:norm_grad_not_all_reduced"),
                   "torchtitan.tp.stock", budget=100, expects=("grad",)),
            Canary("torchtitan_keeps_last_micro_step",
                   lambda: TorchtitanPath("canary.torchtitan_keeps_last_micro_step", "none", False,
                                          "harness.paths.torchtitan.canaries:keeps_last_micro_step", timeout=60.0),
                   "torchtitan.fsdp.stock", budget=100)]
