"""Tolerance mode judges what it can and counts what it cannot.

The term bounds alone let a zeroed, halved or sign-flipped grad agree in
about one tolerance case in seven; capped by the float32 noise eager itself
shows on each tensor (``values.NOISE_K``), never below the rounding of the
case's largest grad, a wrong grad agrees only where float32 cannot tell it
apart, and such a case is counted unjudged.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings

from harness.case import opinfo
from harness.case.spec import Case
from harness.compare.values import NOISE_K, Tolerance, blind_to
from harness.engine.check import CaseCheck
from harness.engine.result import Result, Tally
from harness.observation import Observation, Step
from harness.engine.target import Target
from harness.paths import resolve
from oracles.eager import observe

DATA = os.path.join(os.path.dirname(__file__), "..", "data")


def _tol(bound: torch.Tensor, err: float, top: float, largest: float) -> Tolerance:
    eps = 2.0**-23 * 128
    tol = Tolerance(False, eps, {"w": bound}, float(bound.max()))
    object.__setattr__(tol, "noise", {("param", "w", 0): (err, top), ("param", "*", 0): (0.0, largest)})
    return tol


def _two_backwards(g: torch.Tensor, own: torch.Tensor) -> Observation:
    """An oracle of two backwards of one parameter ``w``: ``g`` after the
    first, ``own`` the second's contribution."""
    return Observation("eager", steps=[Step(0, {"w": g}, {}, []), Step(1, {"w": g + own}, {}, [])],
                       contributions=[{"w": g}, {"w": own}])


def test_the_noise_caps_the_term_bound_never_below_the_largest_grad_s_rounding():
    bound = torch.tensor([1e3, 1.0, 1e-3])
    by_terms = 2.0**-23 * 128 * (bound + 1e-3 * float(bound.max()))
    tol = _tol(bound, err=1e-7, top=2.0, largest=2.0)
    got = tol.allowed("w", bound.shape, ("param", "w", 0))
    assert torch.allclose(got, torch.clamp(by_terms, max=max(NOISE_K * 1e-7, tol.eps * 2.0)))
    assert float(got[0]) < float(by_terms[0])  # a loose term bound, capped by what float32 shows
    assert torch.equal(tol.allowed("w", bound.shape), by_terms)  # unmeasured: the term bound as before
    # A grad cancelling to ~0 beside grads of order one: eager's exact cancellation says nothing
    # about another order, so the cap keeps the rounding of the case's largest grad.
    near_zero = _tol(bound, err=0.0, top=1e-12, largest=3.0)
    assert float(near_zero.allowed("w", bound.shape, ("param", "w", 0))[0]) == pytest.approx(near_zero.eps * 3.0)


def test_an_input_grad_that_cancels_is_held_to_the_rounding_of_the_backward_s_largest_grad():
    """A layer norm over two elements leaves x0's grad 4.6e-8 beside a gain
    grad of order one: eager's order came out 6e-11 off, vmap's 1.5e-8, one
    float32 step of its terms. The floor is every grad of that backward's
    largest, not only the input grads' (here x0 itself)."""
    tol = Tolerance(False, 2.0**-23 * 128, {}, 5.0)
    object.__setattr__(tol, "noise", {("input grad", "x0", 0): (6e-11, 4.6e-8), ("input grad", "*", 0): (0.0, 4.6e-8),
                                      ("param", "*", 0): (0.0, 2.0)})
    allowed = tol.allowed("x0", torch.Size([2]), ("input grad", "x0", 0))
    assert allowed == pytest.approx(tol.eps * 2.0) and allowed > 1.5e-8
    object.__setattr__(tol, "noise", {k: v for k, v in tol.noise.items() if k[0] != "param"})
    assert tol.allowed("x0", torch.Size([2]), ("input grad", "x0", 0)) < 1.5e-8  # its own kind alone: too tight


def test_covers_agrees_with_allowed_and_measures_the_noise_only_where_the_term_bound_covers():
    bound = torch.tensor([1e3, 1.0, 1e-3])
    by_terms = 2.0**-23 * 128 * (bound + 1e-3 * float(bound.max()))
    for err in (1e-7, 1e-3):
        tol, runs = _tol(bound, err=err, top=2.0, largest=2.0), []
        noise = tol.noise
        object.__setattr__(tol, "_noise_of", lambda: runs.append(1) or noise)
        at = ("param", "w", 0)
        assert not tol.covers("w", by_terms * 2, at) and runs == []  # past the term bound: no eager run
        for magnitude in (by_terms * 2, by_terms / 2, torch.zeros(3)):
            assert tol.covers("w", magnitude, at) == bool((magnitude <= tol.allowed("w", bound.shape, at)).all())
        assert runs == [1]
    assert Tolerance(True, 0.0, {}, 0.0).covers("w", torch.zeros(2)) is True


def test_a_case_is_blind_to_a_halved_grad_before_a_zeroed_one_and_to_a_dropped_microbatch():
    """The nearest wrong grad is a halved one: a tolerance that lets it agree
    may still see a zeroed grad, and the case is unjudged all the same. A
    microbatch whose contribution sits inside the tolerance of the summed
    grad cannot be seen missing."""
    bound = torch.tensor([1.0, 1.0])
    tol = _tol(bound, err=1e-6, top=1.0, largest=1.0)  # the term bound, about 1.5e-5, below the cap
    allowed = float(tol.allowed("w", bound.shape, ("param", "w", 0)).max())

    big, small = torch.tensor([1.0, -1.0]), torch.tensor([allowed * 1.5, 0.0])
    assert blind_to(tol, _two_backwards(big, big), 2) == set()
    assert blind_to(tol, _two_backwards(small, big), 2) == {"halved"}  # half of it is within, all of it is not
    assert blind_to(tol, _two_backwards(small / 2, big), 2) == {"halved", "zeroed"}
    assert blind_to(tol, _two_backwards(big, small / 2), 2) == {"dropped"}
    assert blind_to(tol, _two_backwards(big, small / 2), 1) == set()  # one microbatch: nothing to drop
    assert blind_to(Tolerance(True, 0.0, {}, 0.0), _two_backwards(small / 2, small / 2), 2) == set()


def test_a_wrong_grad_within_float64_s_own_rounding_is_no_wrong_grad_and_not_a_blind_spot():
    """A grad or a microbatch's contribution no larger than float64's rounding
    where eager float32 was measured (its error scaled by 2**-29, NOISE_K
    times) is one the oracle cannot tell from zero: zeroing or dropping it
    leaves the right answer. Just above that, the case stays unjudged; and
    where float32 came out exact nothing is called float64's rounding."""
    err = 1e-3
    rounding = NOISE_K * err * 2.0**-52 / 2.0**-23
    tol = _tol(torch.tensor([1.0, 1.0]), err=err, top=1.0, largest=1.0)
    object.__setattr__(tol, "noise_scale", 2.0**-29)  # a float64 case: eager float32 stands in

    big = torch.tensor([1.0, -1.0])
    below, above = torch.tensor([rounding, 0.0]), torch.tensor([rounding * 4, 0.0])
    assert tol.rounds_to_zero(below, ("param", "w", 0)) and not tol.rounds_to_zero(above, ("param", "w", 0))
    object.__setattr__(tol, "noise", {**tol.noise, ("param", "w", 1): (err, 1.0)})
    assert blind_to(tol, _two_backwards(below, big), 2) == set()
    assert blind_to(tol, _two_backwards(above, big), 2) == {"halved", "zeroed", "flipped"}
    assert blind_to(tol, _two_backwards(big, below), 2) == set()
    assert blind_to(tol, _two_backwards(big, above), 2) == {"dropped"}
    exact_there = _tol(torch.tensor([1.0, 1.0]), err=0.0, top=1.0, largest=1.0)
    assert not exact_there.rounds_to_zero(torch.tensor([1e-300, 0.0], dtype=torch.float64), ("param", "w", 0))


def _hidden(n: int, terms_only: bool) -> tuple[int, int]:
    """(tolerance cases, cases where a zeroed, halved or flipped grad after
    the first backward would agree) over n eager.accumulate draws, seed 1."""
    path, counts = resolve("eager.accumulate")[0], [0, 0]

    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), phases=(Phase.generate,),
              database=None)
    @seed(1)
    @given(Target([path]).strategy())
    def draw(case) -> None:  # type: ignore[no-untyped-def]
        tol = Tolerance.for_case(case)
        if path.supports(case) is not None or tol.exact:
            return
        oracle = observe(case)
        if not terms_only:
            tol = tol.with_noise(case, oracle, lambda: path.run(case))
        counts[0] += 1
        counts[1] += bool(blind_to(tol, oracle, 1) & {"zeroed", "halved", "flipped"})

    draw()
    return counts[0], counts[1]


def test_a_wrong_grad_agrees_far_less_often_than_under_the_term_bounds_alone():
    cases, before = _hidden(150, terms_only=True)
    _, after = _hidden(150, terms_only=False)
    assert cases >= 50
    assert before >= 8, before  # what the noise cap is for: the term bounds alone hide these
    assert after <= max(1, cases // 100), (after, cases)


def _data_case(name: str) -> Case:
    with open(os.path.join(DATA, name)) as f:
        raw = json.load(f)
    if any(n["op"] == "opinfo" and dict(n["attrs"])["fn"] not in opinfo.table() for n in raw["nodes"]):
        pytest.skip(f"an op of the case is not in torch {opinfo.version_key()}'s table")
    return Case.from_json(raw)


def test_a_float64_case_is_judged_by_eager_float32_s_noise_scaled_to_float64():
    """A float64 case (training steps) has no eager noise of its own, since
    float64 eager is the oracle; its norms and attention make term bounds of
    1e18, which hid every wrong grad. Eager in float32, its error scaled by
    float64's step over float32's, caps them: no wrong grad agrees, and
    paths computing in other orders still agree."""
    case = _data_case("unjudged_norm_attention_case.json")
    cc = CaseCheck(case)
    mb = case.schedule.microbatches
    assert case.dtype == "float64"
    assert blind_to(Tolerance.for_case(case), cc.oracle, mb, "float64") == {"halved", "zeroed", "flipped", "dropped"}
    assert cc.tol.noise_scale == 2.0**-29
    assert not cc.unjudged()
    for name in ("split.fixed", "checkpoint.fixed", "eager.accumulate"):
        assert cc.run(resolve(name)[0]) == [], name


def test_a_wrong_grad_the_case_s_dtype_cannot_hold_is_no_blind_spot():
    """A grad that underflows in float32, or a microbatch's contribution that
    rounds away beside the float32 sum it joins, is the same wrong or right
    for a float32 path: it is not counted unjudged there, and still is in
    float64, which holds it."""
    tol = _tol(torch.tensor([1.0, 1.0]), err=0.0, top=1.0, largest=1.0)

    big = torch.tensor([1.0, -1.0], dtype=torch.float64)
    tiny = torch.tensor([1e-50, 0.0], dtype=torch.float64)
    assert blind_to(tol, _two_backwards(tiny, big), 2, "float32") == set()
    assert blind_to(tol, _two_backwards(tiny, big), 2, "float64") == {"halved", "zeroed", "flipped"}
    rounds_away = torch.tensor([1e-9, 0.0], dtype=torch.float64)
    assert blind_to(tol, _two_backwards(big, rounds_away), 2, "float32") == set()
    assert blind_to(tol, _two_backwards(big, rounds_away), 2, "float64") == {"dropped"}
    assert blind_to(tol, _two_backwards(big, rounds_away * 1e3), 2, "float32") == {"dropped"}  # 1e-6 beside 1: held


def test_an_unjudgeable_case_is_counted_and_shown_never_as_a_plain_pass():
    case = _data_case("unjudged_dropped_microbatch_case.json")
    assert case.dtype == "float32" and case.schedule.microbatches == 4
    # The fourth microbatch adds 4.5e-6 to g0's 0.89 (38 float32 steps of it, 250 times eager
    # float32's own error there) beside a grad of 2.95 elsewhere: under the floor of 128 steps
    # of the largest grad, so a path that drops it agrees
    assert CaseCheck(case).unjudged()
    from harness.cli.report import summary

    result = Result(paths={"eager.accumulate": Tally(examples=4, run=4, unjudged=3)})
    assert "3 unjudged (a wrong grad would agree)" in summary(result)


def test_a_wrong_grad_no_further_off_than_eager_in_the_case_s_type_is_no_blind_spot():
    """w1's grad, 4e-15 beside grads of 1 and 2, comes out 7e-15 off in
    eager float32 itself: zeroed, it is as right as eager's own, so no
    float32 path can be told apart by it; the case is not unjudged."""
    case = _data_case("unjudged_zeroed_tiny_grad_case.json")
    cc = CaseCheck(case)
    w1, err = cc.oracle.steps[0].grads["w1"], cc.tol._noise()[("param", "w1", 0)][0]
    assert case.dtype == "float32" and float(w1.abs().max()) < err
    assert not cc.unjudged()
    assert blind_to(Tolerance.for_case(case), cc.oracle, case.schedule.microbatches, "float32")  # the term bounds alone


def test_a_path_computing_in_bf16_is_capped_by_eager_computing_in_bf16():
    """A path whose forward and backward run in bfloat16 (DeepSpeed's bf16
    engine) has no exact account of its rounding: against term sizes alone a
    zeroed grad agreed; capped by what eager shows computing the same case in
    bfloat16 (``LOW_NOISE_K``), eager's own bf16 grads agree and a zeroed or
    halved one does not."""
    with open(os.path.join(DATA, "bf16_reduce_rms_norm_case.json")) as fh:
        case = Case.loads(fh.read())
    cc = CaseCheck(case)
    plain = Tolerance.for_case(case).lowered("bfloat16", case)
    capped = Tolerance.for_case(case).with_noise(case, cc.oracle, lambda: None, cc._eager_low).lowered("bfloat16", case)
    want, twin = cc.oracle.steps[0].grads["g0"], cc._eager_low("bfloat16").steps[0].grads["g0"]
    at = ("param", "g0", 0)

    def agrees(tol: Tolerance, got: torch.Tensor) -> bool:
        return bool(((got - want).abs() <= tol.allowed("g0", want.shape, at)).all())

    assert not torch.equal(twin, want)  # bfloat16 really rounds
    assert agrees(plain, want * 0), "term sizes no longer let the zeroed grad agree: pick another case"
    assert agrees(capped, twin) and not agrees(capped, want * 0) and not agrees(capped, twin / 2)


def test_a_neighbour_s_floor_gives_way_to_the_tensor_s_own_where_a_jittered_run_agrees():
    """A grad of order one beside one of 3,000: the floor of 128 float32 steps
    of the largest (0.046) would let a difference of 0.012 agree. A second
    float32 sample, on inputs moved a step, that shows the tensor's own
    rounding small brings the cap to its own (128 steps of 1, or 64 times the
    larger error); one that shows a cancellation (1e-3) never loosens the
    cap past the neighbour's floor. Differences the least possible cap
    already settles do not run it."""
    tol, runs = _tol(torch.tensor([1e6]), err=1e-8, top=1.0, largest=3000.0), []
    at, diff = ("param", "w", 0), torch.tensor([0.012])
    assert tol.covers("w", diff, at)  # no jittered run to ask: the neighbour's floor
    object.__setattr__(tol, "_jitter_of", lambda: runs.append(1) or {at: (2e-8, 1.0)})
    assert tol.covers("w", torch.tensor([1e-6]), at) and runs == []  # within 128 of its own steps: settled
    assert not tol.covers("w", diff, at) and runs == [1]
    assert float(tol.allowed("w", torch.Size([1]), at)) == pytest.approx(tol.eps * 1.0)
    cancels = _tol(torch.tensor([1e6]), err=1e-8, top=1.0, largest=3000.0)
    object.__setattr__(cancels, "_jitter_of", lambda: {at: (1e-3, 1.0)})
    assert float(cancels.allowed("w", torch.Size([1]), at)) == pytest.approx(tol.eps * 3000.0)


def test_a_case_judged_by_its_own_floor_agrees_on_the_fixed_paths():
    """compile.aot_eager seed 1 drew it four times: the fourth microbatch adds
    0.012 to g0's 1.4 beside a w3 grad of 2,950, under that grad's floor, so
    a dropped microbatch agreed. The jittered run gives g0 its own floor:
    the case is judged, and paths computing in other orders still agree."""
    case = _data_case("judged_by_own_floor_case.json")
    cc = CaseCheck(case)
    no_jitter = Tolerance.for_case(case).with_noise(case, cc.oracle, cc._eager32, cc._eager_low)
    object.__setattr__(no_jitter, "_jitter_of", None)
    assert blind_to(no_jitter, cc.oracle, case.schedule.microbatches, case.dtype) == {"dropped"}
    assert not cc.unjudged()
    for name in ("split.fixed", "checkpoint.fixed", "eager.accumulate"):
        assert cc.run(resolve(name)[0]) == [], name
    once, again = (observe(case, low=torch.float32, jitter=True) for _ in range(2))
    plain = observe(case, low=torch.float32)
    assert all(torch.equal(once.steps[0].grads[n], again.steps[0].grads[n]) for n in once.steps[0].grads)  # seeded
    assert any(not torch.equal(once.steps[0].grads[n], plain.steps[0].grads[n]) for n in once.steps[0].grads)


def test_a_cancellation_float32_loses_keeps_its_neighbour_s_floor():
    """A float64 w2 grad of 5.3e-9 beside grads of 9 that eager float32 gets
    half wrong in both runs: float32 kept no bit of it, so its error (scaled
    to float64) says nothing of the rounding in another order, and DTensor's
    sum of shards came 4.7e-16 off, over that scaled cap. The own floor is
    refused there; the neighbour's holds and dtensor.fixed agrees."""
    at = ("param", "w", 0)
    tol = Tolerance(False, 2.0**-52 * 128, {"w": torch.tensor([1e6])}, 1e6, noise_scale=2.0**-29)
    object.__setattr__(tol, "noise", {at: (2.7e-9, 5.3e-9), ("param", "*", 0): (0.0, 9.0)})
    object.__setattr__(tol, "_jitter_of", lambda: {at: (2.7e-9, 5.3e-9)})
    diff = torch.tensor([4.7e-16])
    assert float(tol.allowed("w", torch.Size([1]), at, diff)) == pytest.approx(tol.eps * 9.0)
    object.__setattr__(tol, "noise", {at: (1e-15, 5.3e-9), ("param", "*", 0): (0.0, 9.0)})  # float32 kept it
    object.__setattr__(tol, "_jitter_of", lambda: {at: (1e-15, 5.3e-9)})
    assert float(tol.allowed("w", torch.Size([1]), at, diff)) < 1e-20

    case = _data_case("float32_loses_cancellation_case.json")
    path = resolve("dtensor.fixed")[0]
    if not path.availability().ok:
        pytest.skip(path.availability().reason)
    assert case.dtype == "float64" and CaseCheck(case).run(path) == []
