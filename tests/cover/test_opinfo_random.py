"""Random OpInfo ops (dropout and its kin) in recomputed regions.

The table keeps a random op's samples when the whole screen passes from one
state of the global RNG; a case draws them through the dropout block, every
forward starts from the case's RNG state, and a recomputation must restore
that state to redraw the same mask.
"""

from __future__ import annotations

import pytest

from harness.case import opinfo
from harness.case.ops import draws_random
from harness.case.spec import Case, Schedule
from harness.engine.check import check
from harness.generate import interpret
from harness.paths import resolve
from harness.paths.checkpoint.data import Regions
from harness.paths.checkpoint.paths import CheckpointPath, forgets_rng

RANDOM = opinfo.random_draws()
pytestmark = pytest.mark.skipif(not RANDOM, reason=f"no random ops in the op table of torch {opinfo.version_key()}")


def _case(slot: int, variant: int, exact: bool = False) -> Case:
    """x @ w0, a dropout block (variant 0: the harness's own dropout), x @ w1;
    the first three nodes recomputed."""
    case = interpret([("linear", 0, 0), ("dropout", slot, variant), ("linear", 1, 0)], dim=4, batch=2, x_grad=True,
                     exact=exact, out_kind=0, schedule=Schedule(microbatches=2), seed=3)
    return case.with_data("checkpoint", Regions((len(case.nodes) - 1,)))


def _variants() -> list[tuple[int, int]]:
    return [(slot, variant) for slot in range(3) for variant in (1, 2, 3)]


def test_random_ops_are_apart_from_the_opinfo_block_pool():
    assert not set(RANDOM) & set(opinfo.draws())
    assert all(opinfo.is_random(k) for k, _ in RANDOM)
    assert not any(opinfo.is_random(k) for k, _ in opinfo.draws())


def test_the_dropout_block_draws_a_random_opinfo_op_in_tolerance_mode_only():
    keys = {n.attr("fn") for s, v in _variants() for n in _case(s, v).nodes if n.op == "opinfo"}
    assert keys and keys <= {k for k, _ in RANDOM}
    assert all(draws_random(_case(s, v)) for s, v in _variants())
    exact = _case(0, 1, exact=True)
    assert [n.op for n in exact.nodes].count("dropout") == 1 and not any(n.op == "opinfo" for n in exact.nodes)


@pytest.mark.parametrize("slot, variant", _variants())
def test_the_fixed_recomputation_agrees_and_the_canary_that_forgets_the_rng_is_caught(slot, variant):
    case = _case(slot, variant)
    (fixed,) = resolve("checkpoint.fixed")
    (eager,) = resolve("eager.accumulate")
    assert fixed.supports(case) is None and eager.supports(case) is None
    assert not check(case, eager)
    assert not check(case, fixed)
    found = check(case, CheckpointPath("canary.checkpoint_forgets_rng", forgets_rng))
    assert any(d.kind in ("value", "rng") for d in found), [d.detail for d in found]


def test_seed_global_draws_what_torch_manual_seed_draws():
    """Random ops in a case draw from the global generator; the harness seeds
    it without torch.manual_seed's per-accelerator queue, to the same state."""
    import torch

    from harness.materialize.tensors import seed_global

    seed_global(1234)
    a = (torch.rand(5), torch.randn(3, dtype=torch.float64), torch.bernoulli(torch.full((8,), 0.5)))
    torch.manual_seed(1234)
    b = (torch.rand(5), torch.randn(3, dtype=torch.float64), torch.bernoulli(torch.full((8,), 0.5)))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
