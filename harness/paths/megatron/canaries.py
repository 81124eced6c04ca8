"""The megatron family's canaries: a training loop that clears the grad buffer
before a window's last backward (``zero_grad_buffer()`` called once per
microbatch instead of once per iteration, a real misuse), so only the last
micro-step survives, judged against ``megatron.ddp.stock`` as installed; and
a pipeline whose ``finalize_model_grads`` skips the shared embedding's
all-reduce, judged against ``megatron.pp.stock``, and the same under the
interleaved schedule, where the two copies sit on the first rank's first
model chunk and the last rank's last one, judged against ``megatron.vpp.stock``."""

from __future__ import annotations

from typing import Any

from harness.paths.family import Canary


class keeps_last_micro_step:
    @staticmethod
    def before_backward(ddp: Any, micro: int, gas: int) -> None:
        if micro == gas - 1 and micro:
            ddp.zero_grad_buffer()


def canaries() -> list[Canary]:
    from harness.paths.megatron.paths import MegatronPath, MegatronPipePath, MegatronVppPath

    return [Canary("megatron_keeps_last_micro_step",
                   lambda: MegatronPath("canary.megatron_keeps_last_micro_step", False,
                                        "harness.paths.megatron.canaries:keeps_last_micro_step", timeout=60.0),
                   "megatron.ddp.stock", budget=100),
            # Each stage keeps its own copy's grad: the copies differ (replica)
            # and neither is the sum of both uses (value).
            Canary("megatron_pp_skips_embedding_allreduce",
                   lambda: MegatronPipePath("canary.megatron_pp_skips_embedding_allreduce",
                                            "harness.paths.megatron.canaries:skips_embedding_allreduce", 60.0),
                   "megatron.pp.stock", budget=100, expects=("value", "replica")),
            Canary("megatron_vpp_skips_embedding_allreduce",
                   lambda: MegatronVppPath("canary.megatron_vpp_skips_embedding_allreduce",
                                           "harness.paths.megatron.canaries:skips_embedding_allreduce", 60.0),
                   "megatron.vpp.stock", budget=100, expects=("value", "replica"))]


class skips_embedding_allreduce:
    """A planted broken pipeline (``megatron.pp``'s impl hook): its
    ``finalize_model_grads`` runs without ``_allreduce_word_embedding_grads``,
    so each stage keeps only its own copy's grad of the shared weight."""

    @staticmethod
    def finalize(stock: Any) -> Any:
        def finalize(*args: Any, **kwargs: Any) -> Any:
            from harness.paths.megatron.pipe.rank import finalize_module

            module = finalize_module()
            saved = module._allreduce_word_embedding_grads
            module._allreduce_word_embedding_grads = lambda *a, **k: None
            try:
                return stock(*args, **kwargs)
            finally:
                module._allreduce_word_embedding_grads = saved

        return finalize


class drops_token_count:
    """A planted broken pipeline: ``finalize_model_grads`` called without the
    token count under ``calculate_per_token_loss``, so the grads are never
    divided by it (M times too large)."""

    @staticmethod
    def finalize(stock: Any) -> Any:
        def finalize(model: Any, num_tokens: Any = None, **kwargs: Any) -> Any:
            return stock(model, None, **kwargs)

        return finalize
