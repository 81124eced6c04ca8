"""``func.*``: each microbatch's grads from torch.func's transforms, accumulated into ``.grad``.

- ``func.grad``: ``torch.func.grad`` of the microbatch's loss as a function
  of its leaves (trainable parameters, inputs that require grad);
- ``func.vjp``: ``torch.func.vjp`` of the forward, its function fed the
  microbatch's grad outputs;
- ``func.vmap``: ``vmap(grad(loss))`` over the stacked inputs and grad
  outputs of a step's microbatches (per-sample grads, the microbatch as
  the sample), each microbatch's slice accumulated at its own backward;
- ``func.eager``: the twin, ``torch.autograd.grad`` per microbatch in the
  same structure (same leaves, same loop writing ``.grad``): where it
  agrees with the oracle and a transform does not, the transform is wrong.

Every path runs ``run_schedule``: the schedule's rules (steps, zero_grad,
grad_init, the training step) are the loop's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from harness.case.spec import Case
from harness.materialize.schedule import run_schedule
from harness.materialize.tensors import Built
from harness.observation import Grads, Observation
from harness.paths.base import Availability, Options, Repro
from harness.paths.func import script
from harness.paths.func.rules import CONTRACT, TWIN_CONTRACT, VMAP_CONTRACT, refuse, refuse_vmap
from harness.paths.func.transforms import (Leaves, Reach, Tensors, accumulate, input_grads, leaves, loss_of,
                                           outputs_of)

Params = dict[str, torch.nn.Parameter]


@dataclass(frozen=True)
class Bug:
    """What a canary breaks (the identity on every real path): ``grads``
    alters one microbatch's grads before they are accumulated (its index in
    the step, its grads), ``stacked`` the step's stacked grad outputs
    before ``vmap`` reads them."""

    grads: Callable[[int, Tensors], Tensors] = lambda _j, g: g
    stacked: Callable[[list[torch.Tensor]], list[torch.Tensor]] = lambda cots: cots


NO_BUG = Bug()


def _split(values: Tensors, case: Case) -> tuple[Params, Tensors]:
    """The loop's ``{**params, **inputs}`` back into its two dicts."""
    names = {x.name for x in case.inputs}
    return ({n: t for n, t in values.items() if n not in names},  # type: ignore[misc]
            {n: t for n, t in values.items() if n in names})


class _Grad:
    """``func.grad``: the loop's forward is a no-grad evaluation (its outputs
    are what the loop observes); the backward runs ``grad(loss)``, whose own
    forward runs inside the transform with the microbatch's grad outputs."""

    def __init__(self, bug: Bug) -> None:
        self.bug, self.k = bug, -1
        self.built: Built | None = None

    def forward(self, built: Built, values: Tensors) -> list[torch.Tensor]:
        self.built = built
        with torch.no_grad():
            return built.forward(values)

    def backward(self, outs: list[torch.Tensor], cots: list[torch.Tensor], inputs: Tensors, params: Params) -> Grads:
        assert self.built is not None
        self.k += 1
        lv, reach = leaves(params, inputs), Reach()
        loss = loss_of(self.built, lv.frozen, reach)
        (gp, gi), _ = torch.func.grad(loss, argnums=(0, 1), has_aux=True)(lv.params, lv.inputs, lv.consts, cots)
        accumulate(params, self.bug.grads(self.k % self.built.case.schedule.microbatches, gp), reach)
        return input_grads(inputs, gi, reach)


class _Vjp:
    """``func.vjp``: the loop's forward is ``vjp(f)`` (its primal outputs are
    what the loop observes); the backward feeds the grad outputs to its function."""

    def __init__(self, bug: Bug) -> None:
        self.bug, self.k = bug, -1
        self.pending: tuple[Callable[..., Any], Reach] | None = None
        self.microbatches = 1

    def forward(self, built: Built, values: Tensors) -> list[torch.Tensor]:
        params, inputs = _split(values, built.case)
        lv, reach = leaves(params, inputs), Reach()
        outs, fn = torch.func.vjp(outputs_of(built, lv.frozen, reach), lv.params, lv.inputs, lv.consts)
        self.pending, self.microbatches = (fn, reach), built.case.schedule.microbatches
        return outs

    def backward(self, outs: list[torch.Tensor], cots: list[torch.Tensor], inputs: Tensors, params: Params) -> Grads:
        assert self.pending is not None
        (fn, reach), self.pending = self.pending, None  # the user drops the vjp function after its one call
        self.k += 1
        gp, gi, _ = fn(cots)
        accumulate(params, self.bug.grads(self.k % self.microbatches, gp), reach)
        return input_grads(inputs, gi, reach)


class _Vmap:
    """``func.vmap``: at a step's first forward, ``vmap(grad(loss))`` over
    every microbatch of the step (their inputs and grad outputs stacked, as
    the loop builds them, the parameters shared); each forward returns its
    microbatch's slice of the outputs, each backward accumulates its slice
    of the grads. Microbatches within a step are independent (the
    parameters change only at the step's end), so this is the per-sample
    grad pattern with the microbatch as the sample, and every ``.grad`` the
    loop reads between microbatches is comparable."""

    def __init__(self, bug: Bug) -> None:
        self.bug, self.k, self.microbatches = bug, -1, 1
        self.step: tuple[Tensors, Tensors, list[torch.Tensor], Reach] | None = None

    def forward(self, built: Built, values: Tensors) -> list[torch.Tensor]:
        self.k += 1
        self.microbatches = built.case.schedule.microbatches
        j = self.k % self.microbatches
        if j == 0:
            self.step = self._run_step(built, values)
        assert self.step is not None
        return [o[j] for o in self.step[2]]

    def _run_step(self, built: Built, values: Tensors) -> tuple[Tensors, Tensors, list[torch.Tensor], Reach]:
        params, _ = _split(values, built.case)
        first = self.k
        batch = [_microbatch(built, k, values) for k in range(first, first + built.case.schedule.microbatches)]
        stacked = [_stack([lv for lv, _ in batch], part) for part in ("inputs", "consts")]
        cots = self.bug.stacked([torch.stack(cs) for cs in zip(*(c for _, c in batch))])
        reach = Reach()
        lv = leaves(params, {})
        fn = torch.func.vmap(torch.func.grad(loss_of(built, lv.frozen, reach), argnums=(0, 1), has_aux=True),
                             in_dims=(None, 0, 0, 0), randomness="same")
        (gp, gi), outs = fn(lv.params, stacked[0], stacked[1], cots)
        return gp, gi, outs, reach

    def backward(self, outs: list[torch.Tensor], cots: list[torch.Tensor], inputs: Tensors, params: Params) -> Grads:
        assert self.step is not None
        gp, gi, _, reach = self.step
        j = self.k % self.microbatches  # the forward just before counted this backward
        accumulate(params, self.bug.grads(j, {n: g[j] for n, g in gp.items()}), reach)
        return input_grads(inputs, {n: g[j] for n, g in gi.items()}, reach)


def _microbatch(built: Built, k: int, values: Tensors) -> tuple[Leaves, list[torch.Tensor]]:
    """Microbatch ``k``'s input leaves and grad outputs, as the loop builds
    them (``_held_inputs``: the case's data, cast to the case's dtype)."""
    device = next(iter(values.values())).device if values else "cpu"
    inputs = {x.name: built.inputs(k)[x.name].to(device, built.dtype).requires_grad_(x.requires_grad)
              for x in built.case.inputs}
    cots = [c.to(device, built.dtype) for c in built.cotangents(k)]
    return leaves({}, inputs), cots


def _stack(batch: list[Leaves], part: str) -> Tensors:
    first: Tensors = getattr(batch[0], part)
    return {n: torch.stack([getattr(lv, part)[n] for lv in batch]) for n in first}


class _Eager:
    """``func.eager``: ``torch.autograd.grad`` of the live outputs with
    their grad outputs, over the same leaves, into the same loop."""

    def __init__(self, bug: Bug) -> None:
        self.bug, self.k, self.microbatches = bug, -1, 1

    def forward(self, built: Built, values: Tensors) -> list[torch.Tensor]:
        self.microbatches = built.case.schedule.microbatches
        return built.forward(values)

    def backward(self, outs: list[torch.Tensor], cots: list[torch.Tensor], inputs: Tensors, params: Params) -> Grads:
        self.k += 1
        wrt = {**{n: p for n, p in params.items() if p.requires_grad},
               **{n: x for n, x in inputs.items() if x.requires_grad}}
        live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
        got = (torch.autograd.grad([o for o, _ in live], list(wrt.values()), [c for _, c in live], allow_unused=True)
               if live and wrt else [None] * len(wrt))
        reach = Reach({n for n, g in zip(wrt, got) if g is not None})
        grads = {n: torch.zeros_like(t) if g is None else g for (n, t), g in zip(wrt.items(), got)}
        gp = {n: g for n, g in grads.items() if n in params}
        accumulate(params, self.bug.grads(self.k % self.microbatches, gp), reach)
        return input_grads(inputs, {n: g for n, g in grads.items() if n in inputs}, reach)


LOOPS: dict[str, type] = {"grad": _Grad, "vjp": _Vjp, "vmap": _Vmap, "eager": _Eager}
WHAT = {
    "grad": "torch.func.grad of each microbatch's loss over its leaves",
    "vjp": "torch.func.vjp of each microbatch's forward, fed its grad outputs",
    "vmap": "torch.func.vmap(grad(loss)) over a step's microbatches, per-microbatch grads accumulated",
    "eager": "torch.autograd.grad per microbatch in the func paths' structure (their twin)",
}


class FuncPath:
    """One torch.func transform behind the shared schedule loop (``bug``: a canary's)."""

    workarounds = ("optimizer-for-loop",)  # clone-grads hooks AccumulateGrad, which no func path runs

    def __init__(self, variant: str, name: str = "", bug: Bug = NO_BUG) -> None:
        self.variant, self.bug = variant, bug
        self.name = name or f"func.{variant}"
        self.contract = {"eager": TWIN_CONTRACT, "vmap": VMAP_CONTRACT}.get(variant, CONTRACT)

    def availability(self) -> Availability:
        if not hasattr(torch, "func"):
            return Availability(False, f"torch {torch.__version__} has no torch.func")
        return Availability(True, WHAT[self.variant])

    def supports(self, case: Case) -> str | None:
        return refuse_vmap(case) if self.variant == "vmap" else refuse(case)

    def run(self, case: Case) -> Observation:
        loop = LOOPS[self.variant](self.bug)
        return run_schedule(case, self.name, loop.backward, forward=loop.forward, observe=self.contract.observe())

    def repro(self, case: Case) -> Repro:
        return script.repro(self.variant, case)


def paths(_options: Options) -> list[FuncPath]:
    return [FuncPath(v) for v in ("grad", "vjp", "vmap", "eager")]

