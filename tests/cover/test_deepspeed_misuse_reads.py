"""A misuse's grad read that DeepSpeed refuses on some ranks only (a
60-example misuse gate, seed 1, stopped at 1,500 s without a verdict).

At ZeRO 2, ``engine.step()`` once a window without
``set_gradient_accumulation_boundary`` leaves the window's end unreduced, and
``safe_get_full_grad`` raises ("Gradients are only available immediately
after backward and before engine step") on the ranks that hold a slice of
the parameter, while a rank that holds none goes straight into the read's
all_reduce. The rank code caught the raise and walked on, so its peer
waited in that all_reduce: the case timed out after the path's timeout, the
pool restarted its ranks, and the gate shrank that timeout (its own hang)
one 62 s step after another. A window later the stray all_reduce paired
with another collective and the gloo error read as DeepSpeed's refusal.
The ranks now agree before reading: the grads are out of sight on all of
them, and the skipped optimizer step is the finding."""

import importlib.util
import time

import pytest

from harness.case.spec import Case, Input, Node, Param, Schedule, Use

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed: pip install 'gradfuzz[deepspeed]'")

TIMEOUT = 30.0  # the path's own is 60 s; a case here takes 1 to 6 s on a loaded 2-core machine


def _two_weights(steps: int) -> Case:
    """Two 3x3 weights: ZeRO 2 on two ranks gives each rank one whole weight."""
    from harness.paths.deepspeed.data import Knobs

    case = Case(params=(Param("w0", (3, 3)), Param("w1", (3, 3))), inputs=(Input("x0", (2, 3), requires_grad=True),),
                nodes=(Node("n0", "matmul", (Use("x0"), Use("w0"))), Node("n1", "matmul", (Use("n0"), Use("w1")))),
                outputs=(Use("n1"),), schedule=Schedule(microbatches=2, steps=steps))
    return case.with_data("deepspeed", Knobs(misuse="step_at_boundary"))


@needs_deepspeed
@pytest.mark.parametrize("steps", [1, 2])
def test_a_grad_read_refused_on_one_rank_is_out_of_sight_on_every_rank_not_a_hang(steps):
    """One window: before, a 'timeout' violation after the full timeout
    (rank 1 in safe_get_full_grad's all_reduce). Two windows: before, a
    'refused' gloo 'Connection reset by peer'. Now both end in seconds with
    the skipped optimizer step, the finding this misuse makes."""
    from harness.paths.deepspeed.paths import MisusePath, warm

    path = MisusePath("deepspeed.zero2.misuse", 2, timeout=TIMEOUT)
    try:
        warm(path.group)  # DeepSpeed's first start, outside the case's time
        t0 = time.monotonic()
        obs = path.run(_two_weights(steps))
        took = time.monotonic() - t0
    finally:
        path.close()
    kinds = [v.kind for v in obs.violations]
    assert "refused" not in obs.extra, obs.extra
    assert "timeout" not in kinds, [v.detail[:300] for v in obs.violations]
    assert kinds and set(kinds) == {"step"}, [v.detail[:300] for v in obs.violations]
    assert took < TIMEOUT, took
