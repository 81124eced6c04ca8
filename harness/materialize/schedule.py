"""The one schedule: microbatches, steps, ``zero_grad`` and the loop most paths share.

A case's schedule is ``steps`` x ``microbatches`` backwards; ``zero_grad``
runs before the first backward of every step but the first, and the
training step (clip, then optimizer) after the last backward of each. The
oracle, ``run_schedule`` and every rank's own loop (DTensor, pipeline) call
the rules below instead of restating them, so they cannot disagree on what
a schedule means.

``run_schedule`` is the microbatch loop for paths that train by backward:
they supply their backward (and, if they wrap the module, their forward);
the loop takes the snapshots and the stability checks, so every path is held
to the same rules.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from harness.materialize import workarounds
from harness.materialize.lifetime import Lifetime
from harness.materialize.tensors import Built
from harness.materialize.train import Trainer
from harness.case.spec import Case
from harness.observation import Failure, Grads, Mutation, Observation, Step, Violation, rng_digest, snap


def has_step(case: Case) -> bool:
    s = case.schedule
    return bool(getattr(s, "clip", "") or getattr(s, "optimizer", ""))


def ends_window(case: Case, k: int) -> bool:
    """Is backward ``k`` the last microbatch of its accumulation window (where
    data-parallel wrappers synchronise, and a training step runs)?"""
    return (k + 1) % case.schedule.microbatches == 0


def ends_step(case: Case, k: int) -> bool:
    """Is backward ``k`` the last microbatch of a step (where the step runs)?"""
    return has_step(case) and ends_window(case, k)


def first_inexact(case: Case) -> int | None:
    """The first backward whose grads depend on a training step (None: none do).

    After an optimizer step the parameters are no longer small integers, and
    a clipped grad kept by ``zero_grad="keep"`` is scaled by an irrational
    factor: from there on values are compared with a relative tolerance.
    """
    s = case.schedule
    if s.steps < 2 or not has_step(case):
        return None
    if s.optimizer or s.zero_grad == "keep":
        return s.microbatches
    return None


def starts_step(case: Case, k: int) -> bool:
    """Does backward ``k`` open a new step (so ``zero_grad`` runs before it)?"""
    return k > 0 and k % case.schedule.microbatches == 0


# backward(outputs, grad_outputs, inputs, params) -> input grads it returned
Backward = Callable[
    [list[torch.Tensor], list[torch.Tensor], dict[str, torch.Tensor], dict[str, torch.nn.Parameter]],
    Grads,
]
Forward = Callable[[Built, dict[str, torch.Tensor]], list[torch.Tensor]]


def _default_forward(built: Built, values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return built.forward(values)


def make_params(built: Built, device: str = "cpu") -> dict[str, torch.nn.Parameter]:
    params = {}
    values = built.params()
    for p in built.case.params:
        params[p.name] = torch.nn.Parameter(
            values[p.name].to(device, built.dtype), requires_grad=p.requires_grad
        )
    workarounds.on_params(params)
    init = built.case.schedule.grad_init
    prefill = built.prefill()
    for p in built.case.params:
        if not p.requires_grad or init == "none":
            continue
        t = params[p.name]
        t.grad = torch.zeros_like(t) if init == "zero" else prefill[p.name].to(device, built.dtype)
    return params


def zero_grad(params: Iterable[torch.Tensor], how: str) -> None:
    """The case's ``zero_grad`` on tensors whose ``.grad`` the machinery fills."""
    for p in params:
        if how == "set_to_none":
            p.grad = None
        elif how == "zeros" and p.grad is not None:
            p.grad.zero_()


def zeroed(grads: dict[str, torch.Tensor | None], how: str) -> dict[str, torch.Tensor | None]:
    """The same rule out of place, for the oracle's own sums (``keep`` keeps them)."""
    if how == "set_to_none":
        return {n: None for n in grads}
    if how == "zeros":
        return {n: None if g is None else torch.zeros_like(g) for n, g in grads.items()}
    return grads


class Held:
    """Tensors the user holds; they must not change unless the user changes them.

    A held ``.grad`` may change only by being the very tensor that later
    accumulation writes into (AccumulateGrad's documented in-place sum);
    anything else that changes under the user's feet is a mutation.
    """

    def __init__(self) -> None:
        self.items: list[tuple[str, torch.Tensor, torch.Tensor, Callable[[], torch.Tensor | None]]] = []

    def hold(self, what: str, t: torch.Tensor | None, owner: Callable[[], torch.Tensor | None] = lambda: None) -> None:
        if t is not None:
            self.items.append((what, t, t.detach().clone(), owner))

    def release(self, tensors: list[torch.Tensor]) -> None:
        """The user let go of these: stop holding (and checking) them."""
        ids = {id(t) for t in tensors}
        self.items = [it for it in self.items if id(it[1]) not in ids]

    def refresh(self) -> None:
        """The user wrote (zero_grad): what they hold now is the new baseline."""
        self.items = [(w, t, t.detach().clone(), o) for w, t, _, o in self.items]

    def check(self, k: int) -> list[Mutation]:
        found = []
        for what, t, before, owner in self.items:
            if owner() is t:
                continue
            now = t.detach()
            if now.shape != before.shape or not torch.equal(now, before):
                diff = float((now.double() - before.double()).abs().max()) if now.shape == before.shape else float("inf")
                found.append(Mutation(k, what, diff))
        return found


@dataclass(frozen=True)
class Observe:
    """What ``run_schedule`` looks at beyond values (a path's contract says).

    ``leaf_input_grads``: the ``.grad`` a leaf input the user holds gets
    (compared as input grad ``<x>.grad``). ``grad_layout``: every ``.grad``
    has its parameter's strides, as eager's AccumulateGrad guarantees for
    dense parameters (the rule the founding DTensor bug broke).
    ``graph_freed``: once a backward returns and the loop has let go of the
    forward's outputs, nothing that forward saved for backward is alive
    unless the user holds the outputs (checked with weak references to what
    the saved-tensor hooks packed, not by timing or memory). ``rng_state``:
    the CPU RNG state after each backward, for cases that draw random numbers
    (compared with eager's: a recomputation must leave it as eager does).
    """

    leaf_input_grads: bool = True
    grad_layout: bool = True
    graph_freed: bool = False
    # Also while the user holds outputs or retain_grad intermediates (their
    # nodes stay alive, so only the backward itself can have freed the saved
    # tensors). A split backward runs the input-only part of the graph once,
    # with retain_graph=True, and legitimately keeps it until the outputs go.
    graph_freed_while_held: bool = True
    rng_state: bool = False


class _Packed:
    """What a saved-tensor pack hook stores: alive exactly as long as the
    graph keeps that saved tensor, whoever else holds the tensor itself. It
    keeps a detached alias: the tensor itself would reference its own
    grad_fn when it is that node's output, a cycle only gc could free."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t.detach()


class _SavedWatch:
    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []

    def hooks(self) -> Any:
        def pack(t: torch.Tensor) -> _Packed:
            box = _Packed(t)
            self.refs.append(weakref.ref(box))
            return box

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t)

    def alive(self) -> int:
        n = sum(1 for r in self.refs if r() is not None)
        self.refs = []
        return n


def _layout_violations(params: dict[str, torch.nn.Parameter], k: int) -> list[Violation]:
    found = []
    for n, p in params.items():
        g = p.grad
        if g is None or g.shape != p.shape or not p.is_contiguous():
            continue
        if all(a == b for a, b, size in zip(g.stride(), p.stride(), p.shape) if size > 1):
            continue  # a size-1 dim's stride is never used to address an element
        found.append(Violation(
            "layout", k, n,
            f"{n}.grad after backward {k} has strides {tuple(g.stride())}, the parameter {tuple(p.stride())}: "
            f"eager's AccumulateGrad gives .grad the parameter's layout, and optimizers, DDP buckets and "
            f"checkpoint code that view .grad as the parameter see the wrong elements (copy into a tensor "
            f"laid out like the parameter, as torch.autograd's clone_obey_contract does)",
            key="grad layout differs from the parameter's"))
    return found


def run_schedule(
    case: Case,
    name: str,
    backward: Backward,
    forward: Forward = _default_forward,
    device: str = "cpu",
    observe: Observe = Observe(),
) -> Observation:
    built = Built(case)
    watch = _SavedWatch() if observe.graph_freed else None
    obs = Observation(path=name)
    k = -1
    lifetime = None
    try:
        params = make_params(built, device)
        trainer = Trainer(case, params) if has_step(case) else None
        held = Held()
        lifetime = Lifetime(case, params, held, device)
        reported: set[str] = set()
        for p_name, p in params.items():
            held.hold(f"parameter {p_name}", p)
            held.hold(f"{p_name}.grad before backward 0", p.grad, owner=lambda p=p: p.grad)
        sched = case.schedule
        for k in range(sched.backwards):
            if starts_step(case, k):
                zero_grad(params.values(), sched.zero_grad)
                held.refresh()
            inputs, cots = _held_inputs(built, k, device, held)
            outs = _forward(forward, built, {**params, **inputs}, watch)
            out_snaps = [snap(o) for o in outs]
            lifetime.after_forward(k, outs)
            lifetime.begin(k)
            built.fired = {}
            input_grads = backward(outs, cots, inputs, params)
            if device != "cpu":
                torch.cuda.synchronize()
            rng = rng_digest() if observe.rng_state and built.random else None
            _report_mutations(obs, held.check(k), reported)
            seen = lifetime.end(k, obs)
            grads = {n: snap(p.grad) for n, p in params.items()}
            given = _given(input_grads, inputs, observe)
            _grad_violations(obs, params, k, reported, observe)
            obs.steps.append(Step(k=k, grads=grads, input_grads=given, outputs=out_snaps,
                                  retained={n: snap(t.grad) for n, t in built.retained.items()},
                                  seen=seen, fired=dict(built.fired), rng=rng))
            if trainer is not None and ends_step(case, k):
                obs.steps[-1].after_step = trainer.step(snap)
                held.refresh()  # the step wrote parameters and grads: the user's own writes
            _hold_grads(held, params, input_grads, k)
            if watch is not None:
                outs = out_snaps = []  # the loop lets go of the outputs (the user's own holds remain)
                _graph_violation(obs, watch, case, k, reported, observe)
            lifetime.between(k)
    except Exception as e:  # a path that raises is a finding, not a crash
        obs.failure = Failure(k, type(e).__name__, first_line(e))
    finally:
        if lifetime is not None:
            lifetime.close()
    return obs


def _held_inputs(built: Built, k: int, device: str, held: Held) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Backward ``k``'s inputs and grad outputs: the user holds them, so they must not change."""
    inputs = {
        x.name: built.inputs(k)[x.name].to(device, built.dtype).requires_grad_(x.requires_grad)
        for x in built.case.inputs
    }
    cots = [c.to(device, built.dtype) for c in built.cotangents(k)]
    for n, t in inputs.items():
        held.hold(f"input {n} of backward {k}", t)
    for i, c in enumerate(cots):
        held.hold(f"grad output {i} of backward {k}", c)
    return inputs, cots


def _forward(forward: Forward, built: Built, values: dict[str, torch.Tensor],
             watch: _SavedWatch | None) -> list[torch.Tensor]:
    """Under the watch's saved-tensor hooks when the graph must be seen freed."""
    if watch is None:
        return forward(built, values)
    with watch.hooks():
        return forward(built, values)


def _given(input_grads: Grads, inputs: dict[str, torch.Tensor], observe: Observe) -> Grads:
    given = {n: snap(g) for n, g in input_grads.items()}
    if observe.leaf_input_grads:
        given.update({f"{n}.grad": snap(x.grad) for n, x in inputs.items() if x.requires_grad})
    return given


def _report_mutations(obs: Observation, mutations: list[Mutation], reported: set[str]) -> None:
    for m in mutations:
        if m.what not in reported:
            reported.add(m.what)
            obs.mutations.append(m)


def _hold_grads(held: Held, params: dict[str, torch.nn.Parameter], input_grads: Grads, k: int) -> None:
    """What backward ``k`` gave the user is theirs now: it must not change under them."""
    for n, p in params.items():
        held.hold(f"{n}.grad after backward {k}", p.grad, owner=lambda p=p: p.grad)
    for n, g in input_grads.items():
        held.hold(f"grad of input {n} from backward {k}", g)


def _grad_violations(obs: Observation, params: dict[str, torch.nn.Parameter], k: int, reported: set[str],
                     observe: Observe) -> None:
    """A ``.grad`` eager never gives (on a frozen parameter, or laid out unlike its
    parameter) breaks code downstream; each is reported once per run, not per backward."""
    for n, p in params.items():
        if not p.requires_grad and p.grad is not None and f"frozen {n}" not in reported:
            reported.add(f"frozen {n}")
            obs.violations.append(Violation(
                "frozen", k, n, f"frozen parameter {n} (requires_grad=False) has a .grad after backward {k} "
                f"(max {float(p.grad.detach().abs().max()) if p.grad.numel() else 0:g}); eager autograd "
                f"never writes one: a frozen weight's .grad must stay None", key="frozen parameter got a grad"))
    if observe.grad_layout:
        for v in _layout_violations(params, k):
            if f"layout {v.what}" not in reported:
                reported.add(f"layout {v.what}")
                obs.violations.append(v)


def _graph_violation(obs: Observation, watch: _SavedWatch, case: Case, k: int, reported: set[str],
                     observe: Observe) -> None:
    """Forward ``k``'s graph outlived its backward: every microbatch's activations leak.

    The user's own holds (retain_outputs, retain_grad) remain, as they do in
    training code that keeps its losses for logging: a graph they reach must
    still have been freed by the backward."""
    alive = watch.alive()
    held_by_user = case.schedule.retain_outputs or bool(case.retain_grad)
    if held_by_user and not observe.graph_freed_while_held:
        alive = 0
    if alive and "graph" not in reported:
        reported.add("graph")
        obs.violations.append(Violation(
            "graph", k, "autograd graph",
            f"{alive} tensor(s) saved for backward by forward {k} are still held by its graph after "
            f"backward {k} returned; nothing asked to retain the graph, so "
            f"every microbatch's activations leak (pass retain_graph=True only to a backward that is "
            f"followed by another one over the same graph)", key="graph alive after backward"))


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    cause = e.__cause__
    if cause is not None:
        line = f"{line} (caused by {type(cause).__name__}: {first_line(cause)})" if line else f"{type(cause).__name__}: {first_line(cause)}"
    return line[:300]
