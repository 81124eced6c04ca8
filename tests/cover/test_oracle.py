"""The oracle is itself checked: against central finite differences."""

import dataclasses

import torch
from hypothesis import given, settings

from harness.materialize.tensors import Built
from harness.generate import cases
from oracles.eager import observe


def _loss(built: Built, params: dict, k: int) -> torch.Tensor:
    inputs = built.inputs(k)
    outs = built.forward({**params, **inputs})
    return sum((o * c).sum() for o, c in zip(outs, built.cotangents(k)))


@settings(max_examples=40, deadline=None)
@given(cases(exact=False, max_blocks=4, max_microbatches=1))
def test_oracle_matches_finite_differences(case):
    # Scale hooks change the grad on purpose, so they have no derivative to match.
    # The differences run in float64 (as the oracle does): a float32 loss's
    # rounding divided by 2h swamps a gradient of 1e-3.
    case = dataclasses.replace(case, hooks=(), schedule=dataclasses.replace(case.schedule, steps=1), dtype="float64")
    built = Built(case)
    oracle = observe(case).contributions[0]
    params = built.params()
    h = 1e-6
    with torch.no_grad():
        for p in case.params:
            got = oracle[p.name]
            flat = params[p.name].view(-1)
            for i in range(flat.numel()):
                old = float(flat[i])
                flat[i] = old + h
                up = float(_loss(built, params, 0))
                flat[i] = old - h
                down = float(_loss(built, params, 0))
                flat[i] = old
                fd = (up - down) / (2 * h)
                g = 0.0 if got is None else float(got.reshape(-1)[i])
                # relu kinks are measure-zero for Gaussian data; a loose bound suffices
                assert abs(fd - g) <= 1e-4 * (1 + abs(fd)), (p.name, i, fd, g)


def test_oracle_accumulates_out_of_place():
    from tests.helpers import nested

    obs = observe(nested(microbatches=3))
    first = obs.steps[0].grads["w0"].clone()
    assert torch.equal(obs.steps[0].grads["w0"], first)  # later steps never wrote into it
    total = sum(c["w0"] for c in obs.contributions)
    assert torch.equal(obs.steps[-1].grads["w0"], total)
