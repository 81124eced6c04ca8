"""Observation pairs -> Divergences a person can act on.

Exact mode: any difference is a bug. Tolerance mode: each element's
tolerance is proportional to the size of the terms summed into it
(``magnitude_bounds``), never one global epsilon. A value divergence says
how many elements differ, the largest absolute and relative difference, a
fitted ratio (2.0 = counted twice) and, where the actual grad is a clean
combination of the per-microbatch grads, which combination
("2*g2 instead of g1 + g2" is a stale buffer).
"""

from __future__ import annotations

import math
from copy import copy
from dataclasses import dataclass, field
from typing import Callable

import torch

from harness.materialize.tensors import magnitude_bounds
from harness.observation import (GRAD_NONE, HOOK_FIRING, RECOMPUTATION, RNG_STATE, Divergence, Observation, keys,
                                  message_words)
from harness.case.spec import Case
from harness.materialize.schedule import first_inexact
from harness.compare.recompute import recomputations, rng_states

EPS = {"float32": 2.0**-23, "float64": 2.0**-52}
# Values after a training step (clip_grad_norm_, an optimizer) and grads that
# depend on one: relative to the tensor's largest element. Real bugs (a grad
# counted twice, a missed reduction) are differences of order one. In float64
# a step amplifies another order's rounding through ill-conditioned cases
# (norms, attention, OpInfo ops): ddp.fixed and dtensor.fixed came 5e-8 and
# 1e-7 off after two steps, where 1e-9 was allowed.
REL_AFTER_STEP = {"float32": 1e-4, "float64": 1e-6}
SLACK = 128  # rounding steps allowed per unit of term magnitude
# A path that rounds grads to a lower precision than the case's on the way (an
# FSDP2 reduce_dtype of bfloat16, DDP's bf16 compress hook) says so in
# Observation.precision. A reduction rounds each grad a few times (the cast,
# the sums, the cast back); DeepSpeed's bf16 engine (forward and backward in
# bfloat16, fp32 master grads) needed at most 1.79 steps per unit of term size
# on drawn cases (benchmarks/bf16_rounding.py; numbers in docs/benchmarks.md). So the slack is small: 8 bf16 steps are 3% of the term size,
# while the bugs this harness looks for are of order one (a microbatch lost
# or counted twice in a window of up to 8). After a training step, relative
# to the largest element as for the case's own dtype.
LOW_EPS = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
LOW_SLACK = 8
# A reduction in a lower type rounds each rank's local grad once on the way
# in and the sum once per add (two ranks: once), each at most half a low
# step of what it rounds (Observation.rounded): 2 steps is that bound, 4
# leaves room for a wrapper that divides before and after summing.
ROUNDING_STEPS = 4
REL_AFTER_STEP.update({"bfloat16": 3e-2, "float16": 4e-3})


# The float32 noise cap: a tensor's allowed difference is at most NOISE_K
# times eager float32's own largest error on it (against the float64 oracle),
# or SLACK float32 steps of its largest element where eager is closer. A path
# that computes in another order (an all-reduce of shares, Inductor's fused
# kernels) stayed under 2% of that cap on every grad of 150 ddp.fixed and 40
# compile.inductor cases, while the term bounds alone let a zeroed grad agree
# in one tolerance case in nine. The cap never goes below SLACK float32
# steps of the largest tensor of its kind at that backward (every parameter
# grad of the case, every output): a grad that is a cancellation of large
# terms (a w2 grad of 1.6e-12 beside grads of order one) may come out exact in
# eager's order and round by a few steps of its terms in another (DDP's
# all-reduce of two shares gave 1e-9); a grad so much smaller than its
# neighbours is no verdict either way.
NOISE_K = 64
# "Its kind" for a grad is every grad of that backward, parameters', inputs'
# and retained ones alike: an input grad that is the remainder of a layer
# norm over two elements (4.6e-8 beside a gain grad of order one) came out
# 6e-11 off in eager's order and 1.5e-8 off under vmap, one float32 step of
# its terms; held to its own kind's largest (itself) it was a false finding.
_GRADS = ("param", "input grad", "retained grad")
# The bits of a tensor eager float32 must keep (both runs) for its error to
# stand for rounding that scales with the type's step: a cancellation that
# leaves float32 less than that is measured by its neighbours' floor.
LINEAR_BITS = 8
# The same cap where a path computes in a lower type (LOW_EPS) than the case:
# against eager computing in that type. DeepSpeed's bf16 engine came at most
# 2.2 times eager bf16's own largest error on nine grads in ten, 34 times on
# one of 287 (deepspeed.zero1.stock, 98 bf16 cases), that one 0.18% of the
# largest grad, under the floor below; NOISE_K there let a halved grad agree
# in a third of the cases.
LOW_NOISE_K = 8
# Its floor, in steps of the lower type of the largest grad of the case at
# that backward: where eager in that type came out exact, DeepSpeed's engine
# was at most 0.18% of the largest grad off (one step of bfloat16 is 0.39%).
LOW_FLOOR_STEPS = 2


@dataclass(frozen=True)
class Tolerance:
    exact: bool
    eps: float
    bounds: dict[str, torch.Tensor]
    peak: float
    scale: float = 1.0  # the slack's loosening, applied to after-step comparisons too
    precision: str | None = None  # LOW_EPS's type the path rounded to; None: the case's dtype
    # (role, name, backward) -> (eager float32's largest error, the oracle's largest element): the noise cap.
    noise: dict = field(default_factory=dict)
    # (param, backward) -> the size of what the path rounded to ``precision``
    # there, element by element (Observation.rounded): ROUNDING_STEPS of it
    # are allowed on top of the case's own tolerance.
    rounded: dict = field(default_factory=dict)
    # What ``noise`` is multiplied by before it caps: 1 where the case is
    # float32; float64's step over float32's where eager in float32 stands in
    # for a float64 case's own order (float64 eager is the oracle itself).
    noise_scale: float = 1.0

    def with_noise(self, case: Case, oracle: Observation, eager: Callable[[], Observation | None],
                   low: Callable[[str], Observation | None] | None = None) -> "Tolerance":
        """This tolerance capped by the float32 noise eager itself shows on
        each tensor (``NOISE_K``), for cases in tolerance mode. ``eager``
        runs on the first comparison that needs it (None: eager cannot run
        the case). ``low(precision)``: eager with its forward and backward in
        that type, whose noise caps a path that computes in it (``lowered``).
        A float64 case's own eager is the oracle, so eager in float32 stands
        in, its error scaled by float64's step over float32's: rounding in
        another order scales with the type's step, and the term bounds alone
        ran to 1e11 times a grad (a saturated chain) and hid a dropped
        microbatch of 8e-6 beside grads of 2."""
        if low is not None:
            object.__setattr__(self, "_low_of", lambda p: measured_noise(oracle, low(p)))
        if self.exact or self.precision is not None:
            return self
        if case.dtype == "float32":
            object.__setattr__(self, "_noise_of", lambda: measured_noise(oracle, eager()))
        elif case.dtype == "float64" and low is not None:
            object.__setattr__(self, "_noise_of", lambda: measured_noise(oracle, low("float32")))
            object.__setattr__(self, "noise_scale", EPS["float64"] / EPS["float32"])
        if case.dtype in ("float32", "float64") and low is not None:
            object.__setattr__(self, "_jitter_of", lambda: measured_noise(oracle, low("float32", jitter=True)))
        return self

    def _jitter(self) -> dict:
        """``noise`` as measured once more, on inputs moved a float32 step
        (``observe(jitter=True)``): computed on first need."""
        source = getattr(self, "_jitter_of", None)
        if source is not None:
            object.__setattr__(self, "jitter", source())
            object.__setattr__(self, "_jitter_of", None)
        return getattr(self, "jitter", {})

    def _noise(self) -> dict:
        source = getattr(self, "_noise_of", None)
        if source is not None:
            object.__setattr__(self, "noise", source())
            object.__setattr__(self, "_noise_of", None)
        return self.noise

    @classmethod
    def for_case(cls, case: Case, slack: float | None = None, lazy: bool = False) -> "Tolerance":
        """``slack`` (rounding steps per unit of term size) loosens every
        comparison, exact mode included: it exists to prove that selfcheck
        fails when detection is broken."""
        eps = EPS[case.dtype] * (slack if slack is not None else SLACK)
        scale = 1.0 if slack is None else slack / SLACK
        if case.exact and slack is None:
            return cls(True, 0.0, {}, 0.0)
        if lazy:
            return _LazyTolerance(eps, case, scale)
        b = magnitude_bounds(case)
        return cls(False, eps, b, float(b.pop("__peak__")), scale)

    def lowered(self, precision: str | None, case: Case, rounded: dict | None = None) -> "Tolerance":
        """This tolerance for a path that rounded grads to ``precision``
        (``LOW_EPS``): never exact (an integer past 256 is not a bfloat16).
        Where the path says what it rounded (``rounded``), the case's own
        tolerance plus ``ROUNDING_STEPS`` low steps of that, element by
        element; otherwise each element against its term size, capped by
        ``NOISE_K`` times what eager computing in ``precision`` shows (where
        ``with_noise`` was given ``low``)."""
        if precision not in LOW_EPS:
            return self
        if rounded is None:
            out = _LazyTolerance(LOW_EPS[precision] * LOW_SLACK * self.scale, case, self.scale, precision)
            low = getattr(self, "_low_of", None)
            if low is not None:  # capped by the noise eager shows computing in that type
                object.__setattr__(out, "_noise_of", lambda: low(precision))
            return out
        base = _LazyTolerance(EPS[case.dtype] * SLACK * self.scale, case, self.scale) if self.exact else copy(self)
        object.__setattr__(base, "precision", precision)
        object.__setattr__(base, "rounded", rounded)
        return base

    def allowed(self, what: str, shape: torch.Size, at: tuple | None = None,
                diff: torch.Tensor | None = None) -> torch.Tensor | float:
        """What an element may differ by: ``eps`` per unit of its term bound,
        capped by the tensor's float32 noise where ``at`` (role, name,
        backward) was measured. ``diff``: the differences it is for, which
        spare the jittered run where they settle it either way."""
        if self.exact:
            return 0.0
        return self._capped(self._by_terms(what, shape), at, diff) + self._rounding(at)

    def covers(self, what: str, magnitude: torch.Tensor, at: tuple | None = None) -> bool:
        """Whether every element of ``magnitude`` is within ``allowed``. The
        noise cap only lowers the term bound and costs an eager run of its
        own, so it is measured only where the term bound alone covers them."""
        if self.exact:
            return bool((magnitude <= 0.0).all())
        by_terms, rounding = self._by_terms(what, magnitude.shape), self._rounding(at)
        if not bool((magnitude <= by_terms + rounding).all()):
            return False
        return bool((magnitude <= self._capped(by_terms, at, magnitude) + rounding).all())

    def rounds_to_zero(self, t: torch.Tensor, at: tuple) -> bool:
        """Whether ``t``, a wrong grad's difference from the right one, is
        no more than a right computation shows where it was measured
        (``at``): NOISE_K times float64's own rounding (eager float32's
        error there scaled to float64's step), or in a float32 case eager
        float32's own error there. A float32 path off by that much is as
        right as eager itself. Unmeasured (eager in float32 could not run,
        or came out exact there): no."""
        if self.exact or self.precision is not None:
            return False
        err = self._noise().get(at, (0.0, 0.0))[0]
        own = err if self.noise_scale == 1.0 else 0.0
        return bool((t.abs() <= max(NOISE_K * err * EPS["float64"] / EPS["float32"], own)).all())

    def _by_terms(self, what: str, shape: torch.Size) -> torch.Tensor | float:
        bound = self.bounds.get(what)
        if bound is not None and bound.shape == shape:
            return self.eps * bound + self.eps * 1e-3 * self.peak + 1e-30
        return self.eps * self.peak + 1e-30

    def _capped(self, by_terms: torch.Tensor | float, at: tuple | None,
                diff: torch.Tensor | None = None) -> torch.Tensor | float:
        if at is None or at not in self._noise():
            return by_terms
        err, top = self.noise[at]
        kin = _GRADS if at[0] in _GRADS else (at[0],)
        largest = max([self.noise.get((role, "*", at[2]), (0.0, 0.0))[1] for role in kin] + [top])
        k, floor = (NOISE_K, self.eps) if self.precision is None else \
            (LOW_NOISE_K, LOW_EPS[self.precision] * LOW_FLOOR_STEPS * self.scale)
        k = k * self.scale * self.noise_scale
        cap = max(k * err, floor * largest) + 1e-30
        if self.precision is None and floor * largest > max(k * err, floor * top):  # a neighbour's floor binds
            cap = min(cap, self._own_floor(by_terms, at, diff, k, err, top) or cap)
        return _clamped(by_terms, cap)

    def _own_floor(self, by_terms: torch.Tensor | float, at: tuple, diff: torch.Tensor | None, k: float,
                   err: float, top: float) -> float | None:
        """The cap of a tensor whose floor is its largest neighbour's rounding
        (``SLACK`` steps of it) where a second float32 sample, on jittered
        inputs, says its own is enough: ``k`` times the larger of the two
        runs' errors, never below ``SLACK`` steps of the tensor itself
        (``top``, its largest element). A grad that cancels large terms
        moves by a step of those terms when its inputs move by a step, so
        there the jittered run shows what eager's lucky exact cancellation
        hid. Where either run kept fewer than ``LINEAR_BITS`` of the tensor,
        float32 lost it to cancellation and its error no longer scales with
        the type's step (a float64 grad of 5e-9 that both float32 runs got
        half wrong came out 4.7e-16 off under DTensor, over the scaled
        cap): no own floor. None: no own floor, not measured, or not run
        because ``diff`` is within the least this cap can be."""
        own, lost = self.eps * top, top * 2.0**-LINEAR_BITS
        least = max(k * err, own) + 1e-30
        if err > lost or diff is not None and bool((diff <= _clamped(by_terms, least)).all()):
            return None
        measured = self._jitter().get(at)
        if measured is None or measured[0] > lost:
            return None
        return max(k * max(err, measured[0]), own) + 1e-30

    def _rounding(self, at: tuple | None) -> torch.Tensor | float:
        size = self.rounded.get(at[1:]) if at is not None and at[0] == "param" else None
        return 0.0 if size is None else LOW_EPS[self.precision] * ROUNDING_STEPS * self.scale * size


def _clamped(by_terms: torch.Tensor | float, cap: float) -> torch.Tensor | float:
    return torch.clamp(by_terms, max=cap) if isinstance(by_terms, torch.Tensor) else min(by_terms, cap)


# The wrong grads a tolerance must tell from the right one, each as how far
# off it is: a halved grad is the nearest (half of it), so it goes first and
# a tolerance that sees it sees the zeroed and the flipped one too. A dropped
# microbatch is off by that microbatch's own contribution.
WRONGS = (("halved", 0.5), ("zeroed", 1.0), ("flipped", 2.0))


def blind_to(tol: Tolerance, oracle: Observation, microbatches: int, dtype: str = "float64") -> set[str]:
    """The wrong parameter grads ``tol`` would let agree on this case: after
    the first backward, a grad halved, zeroed or sign-flipped; after the last
    backward of the first step (of ``microbatches``), one microbatch's
    contribution dropped. A case blind to any of them is unjudged: its pass
    says nothing about that grad. Not counted: a wrong grad that is the right
    one as far as the oracle or eager in the case's type can tell
    (``Tolerance.rounds_to_zero``), or as far as the case's ``dtype`` can
    hold it (a grad that underflows there, a contribution no larger than
    the rounding of the sum it joins): no path in that type could tell
    them apart."""
    blind: set[str] = set()
    if tol.exact or not oracle.steps:
        return blind
    for name, g in oracle.steps[0].grads.items():
        if g is None or not g.numel() or float(g.abs().max()) == 0:
            continue
        hidden: set[str] = set()
        for kind, off in WRONGS:  # nearest first: one the tolerance sees, it sees the farther ones too
            if not tol.covers(name, g.abs() * off, ("param", name, 0)):
                break
            hidden.add(kind)
        if hidden and not tol.rounds_to_zero(g, ("param", name, 0)) and _held(g, dtype).any():
            blind |= hidden
    last = min(microbatches, len(oracle.steps)) - 1
    for name, own in (oracle.contributions[last] if 0 < last < len(oracle.contributions) else {}).items():
        total = oracle.steps[last].grads.get(name)
        if own is not None and own.numel() and float(own.abs().max()) > 0 \
                and tol.covers(name, own.abs(), ("param", name, last)) \
                and not tol.rounds_to_zero(own, ("param", name, last)) \
                and not _within_reordering(total, own, microbatches, dtype):
            blind.add("dropped")
            break
    return blind


def _within_reordering(total: torch.Tensor | None, own: torch.Tensor, microbatches: int, dtype: str) -> bool:
    """Whether leaving ``own`` out of ``total`` moves no element further
    than summing the ``microbatches`` contributions in another order may
    round it in ``dtype`` (a step of that type per microbatch, at the larger
    of the two sums): no tolerance in that type can see such a microbatch
    missing, since a right path summing in its own order differs as much."""
    if total is None or total.shape != own.shape:
        return False
    total, own = total.double(), own.double()
    if torch.equal(_held(total - own, dtype), _held(total, dtype)):  # rounds away, or underflows, in dtype
        return True
    size = torch.maximum(total.abs(), (total - own).abs())
    return bool((own.abs() <= microbatches * EPS.get(dtype, EPS["float64"]) * size).all())


def _held(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """``t`` as the case's dtype holds it (rounded from float64)."""
    return t.double().to(getattr(torch, dtype))


class _LazyTolerance(Tolerance):
    """Term-size bounds computed on first need: most comparisons settle on
    the cheap test in ``_value`` (every element within eps of its own size),
    and the bounds cost a forward and backward of their own."""

    def __init__(self, eps: float, case: Case, scale: float = 1.0, precision: str | None = None) -> None:
        for k, v in (("exact", False), ("eps", eps), ("bounds", {}), ("peak", 0.0), ("scale", scale), ("noise", {}), ("rounded", {}),
                     ("precision", precision), ("_case", case)):
            object.__setattr__(self, k, v)

    def _by_terms(self, what: str, shape: torch.Size) -> torch.Tensor | float:
        if self._case is not None:
            b = magnitude_bounds(self._case)
            object.__setattr__(self, "peak", float(b.pop("__peak__")))
            object.__setattr__(self, "bounds", b)
            object.__setattr__(self, "_case", None)
        return super()._by_terms(what, shape)


def compare(case: Case, oracle: Observation, obs: Observation, *, retained_grads: bool = True,
            tol: Tolerance | None = None, blind: frozenset[str] = frozenset()) -> list[Divergence]:
    """``retained_grads``: whether the path promises intermediate ``.grad`` from ``retain_grad``.
    ``blind``: the observations (``harness.observation.OBSERVATIONS``) the
    path's contract says its machinery cannot show; compare does not hold it to them."""
    none_matters = GRAD_NONE not in blind
    tol = (tol or Tolerance.for_case(case)).lowered(obs.precision, case, obs.rounded)
    found = _events(case, obs, tol.scale)
    if HOOK_FIRING not in blind:
        found += _hook_counts(obs.path, oracle, obs, retained_grads)
    if RECOMPUTATION not in blind:
        found += recomputations(case, obs)
    if RNG_STATE not in blind:
        found += rng_states(oracle, obs)
    done: set[str] = set()
    inexact = first_inexact(case)
    for o_step, p_step in zip(oracle.steps, obs.steps):
        k = o_step.k
        groups = [("param", o_step.grads, p_step.grads), ("input grad", o_step.input_grads, p_step.input_grads)]
        if retained_grads:
            groups.append(("retained grad", o_step.retained, p_step.retained))
        outs = {f"output {i}": t for i, t in enumerate(o_step.outputs)}
        # None: the path does not observe the case's outputs (torchtitan.tp judges its own model)
        p_outs = None if p_step.outputs is None else {f"output {i}": t for i, t in enumerate(p_step.outputs)}
        groups.append(("output", outs, p_outs))
        if case.schedule.param_hooks:
            groups.append(("hook", _hooks_expected(case, oracle, k), p_step.seen))
        if o_step.after_step:
            groups.append(("after step", o_step.after_step, p_step.after_step))
        for role, expected, actual in groups:
            if actual is None:  # not observable at this backward (a pipeline schedule's mid-step grads)
                continue
            relative = REL_AFTER_STEP[tol.precision or case.dtype] * tol.scale if role == "after step" or (inexact is not None and k >= inexact) else None
            # The path's names too: a grad only the path has (the oracle
            # dropped it, or the path made one up) is compared, not skipped.
            for name in [*expected, *(n for n in actual if n not in expected)]:
                e = expected.get(name)
                key = f"{role}:{name}"
                if key in done:
                    continue
                if role == "input grad" and name.endswith(".grad") and name not in actual:
                    continue  # a leaf input's .grad: observed only where the path's contract says
                a = actual.get(name)
                d = _value(case, obs.path, role, name, k, e, a, tol, oracle, relative, none_matters)
                if d is not None:
                    done.add(key)
                    found.append(d)
    for d in found:
        # A Failure's or Violation's k of -1 means "before any backward" or "the
        # whole group" (a hang, a crash): no backward number. The corpus schema
        # takes a microbatch of 0 or more, or null.
        if d.microbatch is not None and d.microbatch < 0:
            d.microbatch = None
    return found


def _events(case: Case, obs: Observation, scale: float = 1.0) -> list[Divergence]:
    """What the path reported itself: a raise, a tensor changed under the user, a broken invariant."""
    names = case_names(case)
    found: list[Divergence] = []
    if obs.failure is not None:
        f = obs.failure
        found.append(
            Divergence(obs.path, "error", None, f.k, None, None, None,
                       f"raised {f.type}: {f.message} (the eager oracle ran this case fine)",
                       **keys(obs.path, "error", f"{f.type}: {message_words(f.message, names)}"))
        )
    for m in obs.mutations:
        found.append(
            Divergence(obs.path, "mutation", None, m.k, m.max_abs, None, None,
                       f"{m.what} changed by up to {m.max_abs:g} during backward {m.k}, but nobody wrote to it",
                       **keys(obs.path, "mutation", m.what.split(" ")[0]))
        )
    for v in obs.violations:
        if v.excess is not None and v.excess <= scale:
            continue  # within the path's own tolerance loosened by the slack
        found.append(
            Divergence(obs.path, v.kind, v.what, v.k, None, None, None, v.detail,
                       **keys(obs.path, v.kind, v.key or message_words(v.what, names)))
        )
    return found


def case_names(case: Case) -> frozenset[str]:
    """The names a case gave its tensors: never part of a signature."""
    return frozenset(x.name for x in (*case.params, *case.inputs, *case.nodes))


def _none_vs_zeros(path: str, role: str, label: str, k: int, eager_none: bool) -> Divergence:
    """A grad that is None on one side and all zeros on the other. They are
    not the same to a user: a stateful optimizer skips a None grad but counts
    a step (AdamW's step, momentum buffers) for a zero one, and
    ``set_to_none`` logic reads None as "nothing arrived"."""
    where = f"None in eager, a zero tensor on {path}" if eager_none else f"a zero tensor in eager, None on {path}"
    detail = (f"{label} is {where} after backward {k} (a stateful optimizer steps a zero grad and skips a "
              f"None one)")
    return Divergence(path, "value", label, k, 0.0, None, None, detail,
                      **keys(path, "value", f"{role} {'zeros for None' if eager_none else 'None for zeros'}"))


def _value(case, path, role, name, k, e, a, tol: Tolerance, oracle: Observation,
           relative: float | None = None, none_matters: bool = True) -> Divergence | None:
    label = name if role in ("param", "output") else f"{role} {name}"
    if e is None and a is None:
        return None
    if e is None or a is None:
        present = a if e is None else e
        if float(present.abs().max()) == 0 if present.numel() else True:
            return _none_vs_zeros(path, role, label, k, e is None) if none_matters else None
        if a is None:
            detail = f"{label}: no grad after backward {k}, expected max |grad| {float(e.abs().max()):g}"
            return Divergence(path, "value", label, k, float(e.abs().max()), 1.0, 0.0, detail,
                              **keys(path, "value", f"{role} missing"))
        detail = f"{label}: got a grad after backward {k} where autograd gives none (max {float(a.abs().max()):g})"
        return Divergence(path, "value", label, k, float(a.abs().max()), None, None, detail,
                          **keys(path, "value", f"{role} unexpected"))
    if e.shape != a.shape:
        detail = f"{label}: shape {tuple(a.shape)} after backward {k}, expected {tuple(e.shape)}"
        return Divergence(path, "value", label, k, None, None, None, detail, **keys(path, "value", f"{role} shape"))
    diff = (a - e).abs()
    if relative is not None:  # after a training step: optimizer arithmetic, no term bounds
        allowed = relative * (1 + float(e.abs().max()) if e.numel() else 1)
    elif not tol.exact and bool((diff <= tol.eps * e.abs()).all()):
        return None  # within eps of each element's own size, so within eps x term size (bounds >= |e|)
    else:
        allowed = tol.allowed(name if role == "param" else "", e.shape, (role, name, k), diff)
    bad = diff > allowed
    if not bool(bad.any()):
        return None
    max_abs = float(diff.max())
    rel = diff / e.abs().clamp_min(1e-30)
    max_rel = float(rel[bad].max())
    ee = float((e * e).sum())
    ratio = float((a * e).sum()) / ee if ee > 0 else None
    at = tuple(int(i) for i in torch.nonzero(bad)[0]) if e.dim() else ()
    why = (_explain(case, role, name, k, a, oracle) or _explain_sites(case, name, k, a, oracle)) if role == "param" else None
    explain = why.text if why else ""
    tol_txt = ("exact mode: any difference is a bug" if tol.exact else f"tolerance {tol.eps:.1e} x term size") \
        if relative is None else f"after a training step: tolerance {relative:.0e} x the largest element"
    if tol.precision:
        tol_txt += f", the path rounds grads to {tol.precision}"
    detail = (
        f"{label} after backward {k}: {int(bad.sum())} of {e.numel()} elements differ; "
        f"max abs diff {max_abs:g}, max rel diff {max_rel:g} (first at index {at}: "
        f"expected {float(e[at]):g}, got {float(a[at]):g}; {tol_txt})"
        + (f"; ratio actual/expected {ratio:.4g}" if ratio is not None else "")
        + (f"; {explain}" if explain else "")
    )
    shape_of_bug = why.shape if why else _ratio_class(ratio)
    return Divergence(path, "value", label, k, max_abs, max_rel, ratio, detail,
                      **keys(path, "value", f"{role} {shape_of_bug}"))


@dataclass(frozen=True)
class Explanation:
    """A wrong grad expressed in its parts, and the coarse shape of that bug:
    the de-duplication key, stable across the sizes, names and microbatch
    counts of the cases that show it (it goes into the signature)."""

    text: str
    shape: str


def _ratio_class(ratio: float | None) -> str:
    if ratio is None:
        return "ratio=none"
    if not math.isfinite(ratio):  # a NaN or infinite grad where eager's is finite: no multiple to round to
        return f"ratio={ratio!r}"
    nearest = round(ratio * 2) / 2
    return f"ratio~{nearest:g}" if abs(ratio - nearest) < 0.02 else "ratio=irregular"


def _explain_sites(case: Case, name: str, k: int, actual: torch.Tensor, oracle: Observation) -> Explanation | None:
    """Express the actual grad in per-use-site grads: "use at n0 counted 2 times"."""
    from harness.compare.sites import site_contributions

    m = case.schedule.microbatches
    start = 0 if case.schedule.zero_grad == "keep" else (k // m) * m
    if start != k or case.schedule.grad_init == "prefilled":
        return None  # one backward's sites only; accumulation is _explain's job
    try:
        sites = site_contributions(case, k).get(name, [])
    except Exception:  # an explanation is a bonus; never let it mask the finding
        return None
    if len(sites) < 2 or len(sites) > 8:
        return None
    A = torch.stack([t.reshape(-1) for _, t in sites], dim=1)
    y = actual.reshape(-1, 1)
    coef = _solve(A, y)
    if float((A @ coef.reshape(-1, 1) - y).abs().max()) > 1e-6 * (1 + float(y.abs().max())):
        return None
    rounded = [round(float(c), 3) + 0.0 for c in coef]  # + 0.0: -0.0 reads "counted 0 times", not "-0"
    odd = [f"the {lbl} counted {c:g} times" for c, (lbl, _) in zip(rounded, sites) if abs(c - 1) > 1e-6]
    if not odd:
        return None
    return Explanation("; ".join(odd) + f" (each of {len(sites)} use sites should count once)",
                       "a use site counted wrong")


def _solve(A: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The minimum-norm least-squares coefficients (SVD, ``gelsd``). The CPU
    default ``gelsy`` answers a rank-deficient system (a backward whose grad
    is zero) from a work array it does not clear, so one case's explanation,
    and with it the signature, changed between replays in one process
    (pytorch#187411; benchmarks/lstsq_gelsy_flaps.py)."""
    return torch.linalg.lstsq(A, y, driver="gelsd").solution.reshape(-1)


def _explain(case: Case, role: str, name: str, k: int, actual: torch.Tensor, oracle: Observation) -> Explanation | None:
    """Express the actual grad as a combination of per-backward grads, if it is one."""
    m = case.schedule.microbatches
    start = 0 if case.schedule.zero_grad == "keep" else (k // m) * m
    terms: list[tuple[str, torch.Tensor]] = []
    for j in range(start, k + 1):
        g = oracle.contributions[j].get(name)
        if g is not None:
            terms.append((f"g{j + 1}", g))
    if not terms or len(terms) > 8:
        return None
    A = torch.stack([t.reshape(-1) for _, t in terms], dim=1)
    y = actual.reshape(-1, 1)
    init = y.new_zeros(y.shape)
    if case.schedule.grad_init == "prefilled" and start == 0:
        # The prefilled grad is a known constant part of the expected value.
        init = (oracle.steps[k].grads[name].reshape(-1, 1) - A.sum(dim=1, keepdim=True))
    try:
        coef = _solve(A, y - init)
    except RuntimeError:
        return None
    if float((A @ coef.reshape(-1, 1) + init - y).abs().max()) > 1e-6 * (1 + float(y.abs().max())):
        return None
    rounded = [round(float(c), 3) + 0.0 for c in coef]  # + 0.0: -0.0 reads "counted 0 times", not "-0"
    if all(abs(c - 1) < 1e-6 for c in rounded):
        return None
    parts = [f"{c:g}*{lbl}" for c, (lbl, _) in zip(rounded, terms) if abs(c) > 1e-9] or ["0"]
    got = " + ".join(parts)
    want = " + ".join(lbl for lbl, _ in terms)
    text = f"actual = {got}, expected {want}"
    nonzero = [(c, lbl) for c, (lbl, _) in zip(rounded, terms) if abs(c) > 1e-9]
    if len(terms) > 1 and len(nonzero) == 1 and nonzero[0][1] == terms[-1][0]:
        note = f" (the last backward's grad counted {nonzero[0][0]:g} times: a stale or overwritten buffer)"
        return Explanation(text + note, "last backward repeated")
    if len(parts) > 1:
        return Explanation(text, "microbatches mixed")
    # one backward's grad, scaled ("actual = 2*g1"); none at all reads "actual = 0, expected ..."
    times = parts[0].split("*")[0] if "*" in parts[0] else f"{parts[0]}, expected {want}"
    return Explanation(text, f"one backward counted {times} times")


def _hooks_expected(case: Case, oracle: Observation, k: int) -> dict[str, torch.Tensor | None]:
    """What the schedule's parameter hooks should see in backward ``k``:
    ``register_hook`` the grad this backward brings, the post-accumulate hook
    the accumulated ``.grad``."""
    from harness.materialize.lifetime import HOOK_SEEN

    expected: dict[str, torch.Tensor | None] = {}
    for p in case.params:
        if not p.requires_grad:
            continue
        for kind in case.schedule.param_hooks:
            key = f"{p.name} {HOOK_SEEN[kind]}"
            if HOOK_SEEN[kind] == "register_hook":
                expected[key] = oracle.contributions[k].get(p.name)
            else:
                expected[key] = oracle.steps[k].grads.get(p.name) if oracle.contributions[k].get(p.name) is not None else None
    return expected


def _hook_counts(path: str, oracle: Observation, obs: Observation, retained_grads: bool) -> list[Divergence]:
    """A case tensor hook that fires more often than eager fires it, once per
    hook: a logging or clipping hook run twice is wrong whatever the grad
    value (an ``observe`` hook's second run changes no number). Fewer fires
    are left to the values they change: graph wrappers legitimately skip
    Python hooks they document as unsupported. Not so on a path that
    recomputes (its steps count ``recomputed``): a checkpoint runs the
    user's own forward and backpropagates the original graph (or, reentrant,
    the rerun's), so each hook fires exactly as often as in eager, neither
    twice (once on the original tensor, once on its recomputed copy) nor
    never. Tensor hooks sit on intermediates, like ``retain_grad`` (itself a
    tensor hook): a path whose contract does not promise intermediate grads
    (a split backward runs the shared graph once per pass) is not held to
    them. Parameter hooks stay with lifetime's own once-per-backward check."""
    found, done = [], set()
    if not retained_grads:
        return found
    for o_step, p_step in zip(oracle.steps, obs.steps):
        if p_step.fired is None or o_step.fired is None:
            continue
        exact = p_step.recomputed is not None
        hooks = {key for key in (*o_step.fired, *p_step.fired) if key.endswith(" tensor_hook")}
        for key in sorted(hooks):
            count, want = p_step.fired.get(key, 0), o_step.fired.get(key, 0)
            where = key.split(" ", 1)[0]
            if key in done or count == want or (count < want and not exact):
                continue
            done.add(key)
            if count > want:
                found.append(Divergence(
                    path, "hook", where, p_step.k, None, None, count / want if want else None,
                    f"the tensor hook on {where} fired {count} times in backward {p_step.k}; eager autograd fires "
                    f"it {want} time{'s' if want != 1 else ''} (a hook that runs twice applies its effect twice)",
                    **keys(path, "hook", "tensor hook fired N times")))
            else:
                found.append(Divergence(
                    path, "hook", where, p_step.k, None, None, count / want,
                    f"the tensor hook on {where} fired {count} time{'s' if count != 1 else ''} in backward "
                    f"{p_step.k}; eager autograd fires it {want} time{'s' if want != 1 else ''} (a recomputing "
                    f"path runs the user's forward and backward, so every hook eager fires must fire)",
                    **keys(path, "hook", "tensor hook fired fewer times")))
    return found



def measured_noise(oracle: Observation, eager: Observation | None) -> dict:
    """(role, name, backward) -> (eager's largest error, the oracle's largest
    element), for every tensor both observed."""
    out: dict = {}
    if eager is None or eager.failure is not None:
        return out
    for o, e in zip(oracle.steps, eager.steps):
        groups = {"param": (o.grads, e.grads), "input grad": (o.input_grads, e.input_grads),
                  "retained grad": (o.retained, e.retained),
                  "output": (dict(enumerate(o.outputs)), dict(enumerate(e.outputs or ())))}
        for role, (want, got) in groups.items():
            for name, w in (want or {}).items():
                g = (got or {}).get(name)
                if w is None or g is None or w.shape != g.shape or not w.numel():
                    continue
                key = name if role != "output" else f"output {name}"
                out[(role, key, o.k)] = (float((g.double() - w.double()).abs().max()), float(w.abs().max()))
                _, largest = out.get((role, "*", o.k), (0.0, 0.0))
                out[(role, "*", o.k)] = (0.0, max(largest, out[(role, key, o.k)][1]))
    return out
