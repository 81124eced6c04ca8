"""The eager autograd oracle.

Float64, one ``torch.autograd.grad`` per backward, and accumulation done
here, out of place: the oracle does not trust ``AccumulateGrad``'s reuse of
incoming buffers as ``.grad`` (that reuse is exactly where graphed callables
went wrong). Plain ``.backward()`` accumulation is a path of its own,
``eager.accumulate``, held to this oracle like any other.
"""

from __future__ import annotations

from typing import Callable

import torch

from harness.materialize.tensors import Built
from harness.observation import Grads, Observation, Step, rng_digest, snap
from harness.case.spec import Case
from harness.materialize.schedule import ends_step, has_step, starts_step, zeroed
from harness.materialize.train import Trainer


class OracleError(RuntimeError):
    """The oracle itself could not run the case: a generator or spec bug."""


Cotangents = Callable[[int, list[torch.Tensor]], list[torch.Tensor]]


def observe(case: Case, cotangents: Cotangents | None = None, low: torch.dtype | None = None,
            jitter: bool = False) -> Observation:
    """``cotangents`` (backward, the case's grad outputs) -> the grad outputs
    to use instead: one rank's share, for the grads a data-parallel rank
    computes before its wrapper reduces them. ``low``: the forward and
    backward in that type instead, grads summed in float32 and no training
    step, as a mixed-precision engine computes them: not an oracle, but the
    rounding that type shows on this very case. ``jitter`` (with ``low``):
    every parameter, input and grad output one step of that type up or
    down, seeded by the case: a second sample of how far that type's
    rounding moves each grad, where one run may land close by luck."""
    built = Built(case)
    obs = Observation(path="oracle" if low is None else f"eager {low}")
    to = _converter(case, low, jitter)
    params = {n: to(t).requires_grad_(p.requires_grad) for (n, t), p in zip(built.params().items(), case.params)}
    grad_params = [n for n, t in params.items() if t.requires_grad]
    init = case.schedule.grad_init
    acc: Grads = {n: None for n in params}
    if init != "none":
        prefill = built.prefill()
        for n in grad_params:
            acc[n] = torch.zeros_like(params[n]) if init == "zero" else prefill[n]
    sched = case.schedule
    trainer = Trainer(case, params, oracle=True) if has_step(case) and low is None else None
    try:
        for k in range(sched.backwards):
            if starts_step(case, k):
                acc = zeroed(acc, sched.zero_grad)
            inputs = {x.name: to(built.inputs(k)[x.name]).requires_grad_(x.requires_grad) for x in case.inputs}
            outs = built.forward({**params, **inputs})
            cots = [to(c) for c in (built.cotangents(k) if cotangents is None else cotangents(k, built.cotangents(k)))]
            built.fired = {}
            got = _grads(outs, cots, {n: params[n] for n in grad_params}, inputs, low)
            # Every forward starts from the same seeded state; what the
            # forward drew and the backward did not is where eager leaves it.
            rng = rng_digest() if built.random else None
            contribution = {n: snap(got.get(n)) for n in params}
            for n, g in contribution.items():
                if g is not None:
                    acc[n] = g if acc[n] is None else acc[n] + g
            obs.contributions.append(contribution)
            obs.steps.append(
                Step(
                    k=k,
                    grads={n: snap(g) for n, g in acc.items()},
                    input_grads={**{n: snap(got.get(n)) for n in inputs},
                                 # a leaf input's .grad (paths whose contract observes it)
                                 **{f"{n}.grad": snap(got.get(n)) for n, t in inputs.items() if t.requires_grad}},
                    outputs=[snap(o) for o in outs],
                    retained={n: snap(t.grad) for n, t in built.retained.items()},
                    fired=_fired(case, built.fired, contribution),
                    rng=rng,
                )
            )
            if trainer is not None and ends_step(case, k):
                obs.steps[-1].after_step = _train(trainer, params, acc)
    except Exception as e:
        raise OracleError(f"eager oracle failed on backward {k}: {type(e).__name__}: {e}") from e
    return obs


def _converter(case: Case, low: torch.dtype | None, jitter: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """What ``observe`` makes of each parameter, input and grad output: as
    built, in ``low``, or in ``low`` moved a step (seeded by the case)."""
    if low is None:
        return lambda t: t
    if not jitter:
        return lambda t: t.to(low)
    gen = torch.Generator().manual_seed(case.seed)
    return lambda t: _jittered(t.to(low), gen)


def _jittered(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``t`` with each element one step of its type up or down at random."""
    if not t.is_floating_point() or not t.numel():
        return t
    sign = torch.randint(0, 2, t.shape, generator=gen).to(t.dtype) * 2 - 1
    return t * (1 + sign * torch.finfo(t.dtype).eps)


def _grads(outs: list[torch.Tensor], cots: list[torch.Tensor], params: dict[str, torch.Tensor],
           inputs: dict[str, torch.Tensor], low: torch.dtype | None) -> dict[str, torch.Tensor | None]:
    """One ``torch.autograd.grad`` of the outputs that need grad, with
    respect to every trainable parameter and input (None where unused);
    float32 where the backward ran in a lower type."""
    live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    wrt = {**params, **{n: t for n, t in inputs.items() if t.requires_grad}}
    if not (live and wrt):
        return {n: None for n in wrt}
    grads = torch.autograd.grad([o for o, _ in live], list(wrt.values()), [c for _, c in live], allow_unused=True)
    return {n: g if g is None or low is None else g.float() for n, g in zip(wrt, grads)}


def _train(trainer: Trainer, params: dict[str, torch.Tensor], acc: Grads) -> Grads:
    """The schedule's training step on the oracle's own sums (copies: the
    per-backward contributions must not be clipped with them)."""
    for n, p in params.items():
        p.grad = None if acc[n] is None else acc[n].clone()
    seen = trainer.step(snap)
    for n, p in params.items():
        acc[n] = p.grad
        p.grad = None
    return seen


def _fired(case: Case, tensor_hooks: dict[str, int], contribution: Grads) -> dict[str, int]:
    """How often eager fires each hook in one backward: the case's tensor
    hooks as counted on this very backward, and each parameter hook once when
    the parameter gets a grad (AccumulateGrad runs once per backward)."""
    fired = dict(tensor_hooks)
    for p in case.params:
        if p.requires_grad and contribution.get(p.name) is not None:
            for kind in case.schedule.param_hooks:
                fired[f"{p.name} {kind}"] = 1
    return fired
