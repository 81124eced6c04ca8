"""The DeepSpeed family's part of a case: the engine's knobs a user sets in
its config, each a draw that shrinks to DeepSpeed's default."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import strategies as st

from harness.case import schema as sc
from harness.case.namespace import DataNamespace
from harness.case.spec import Case
from harness.generate import Draw

BUCKETS = (0, 8, 10**6)  # reduce_bucket_size: 0 = DeepSpeed's default; 8 elements puts tied weights apart
BF16 = st.sampled_from((False,) * 3 + (True,))  # of the integer-valued cases, shrinking to off
# Ways users drive the engine that DeepSpeed's docs do not describe, each a
# loop a person ports from plain torch or guesses at. What the user meant is
# the documented drive's grads (the oracle); DeepSpeed raising or warning is
# a refusal, silently other grads a finding of the misuse class
# (``path.MisusePath``). Empty: the documented drive.
MISUSES: dict[str, str] = {
    "zero_grad": "engine.zero_grad() before every micro-step (a plain torch loop zeroes before each backward)",
    "optimizer_zero_grad": "optimizer.zero_grad() before every micro-step, on the optimizer deepspeed.initialize "
                           "returned",
    "step_at_boundary": "engine.step() only at a window's end, without set_gradient_accumulation_boundary",
    "backward_twice": "engine.backward twice per micro-step, on halves of the loss (retain_graph=True on the first)",
    "gas1_manual": "gradient_accumulation_steps 1 and accumulation by hand around it: engine.backward every "
                   "micro-step, engine.step() once per window, no no_sync",
}
# The misuses whose loop calls engine.step() once per window, not after every micro-step.
ONE_STEP_A_WINDOW = ("step_at_boundary", "gas1_manual")


@dataclass(frozen=True)
class Knobs:
    bucket: int = 0
    contiguous: bool = True  # zero_optimization.contiguous_gradients
    overlap: bool = False  # zero_optimization.overlap_comm
    scatter: bool = True  # zero_optimization.reduce_scatter
    bf16: bool = False  # bf16.enabled: the module, its forward and backward in bfloat16, fp32 master grads
    misuse: str = ""  # MISUSES: how the loop drives the engine against the docs ("": as documented)
    # fp16.enabled with loss scaling (``FP16``, drawn for the fp16 paths only), DeepSpeed's defaults:
    # loss_scale 0 is dynamic, from 2**scale_power, raised after scale_window steps without overflow.
    fp16: bool = False
    loss_scale: int = 0
    scale_power: int = 16
    scale_window: int = 1000
    hysteresis: int = 2


def knobs(case: Case) -> Knobs:
    return case.data("deepspeed") or Knobs()


def config_gas(case: Case, nosync: bool = False) -> int:
    """The ``gradient_accumulation_steps`` the loop configures: 1 where it
    accumulates by hand (``no_sync``, or the ``gas1_manual`` misuse), else
    the case's microbatches."""
    return 1 if nosync or knobs(case).misuse == "gas1_manual" else case.schedule.microbatches


def config(case: Case, stage: int, batch: int, gas: int | None = None) -> dict:
    """The DeepSpeed config of a case: its accumulation (``gas``, else its
    microbatches), the stage, its knobs."""
    k = knobs(case)
    zero = {"stage": stage, "contiguous_gradients": k.contiguous, "overlap_comm": k.overlap,
            "reduce_scatter": k.scatter}
    if k.bucket:
        zero["reduce_bucket_size"] = k.bucket
        zero["allgather_bucket_size"] = max(k.bucket, 2)
    out = {"train_micro_batch_size_per_gpu": batch,
           "gradient_accumulation_steps": case.schedule.microbatches if gas is None else gas,
           "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
           "wall_clock_breakdown": False}
    if k.bf16:
        out["bf16"] = {"enabled": True}
    if k.fp16:  # clipping off (0.19.8 clips to norm 1.0 by default): the update the step applies is the grad
        out["fp16"] = {"enabled": True, "loss_scale": k.loss_scale, "initial_scale_power": k.scale_power,
                       "loss_scale_window": k.scale_window, "hysteresis": k.hysteresis, "min_loss_scale": 1}
        out["gradient_clipping"] = 0.0
    return out


@st.composite
def _knobs(draw, case: Case) -> Case:
    """bf16 only on integer-valued cases (one in four of them): the engine
    computes those in bfloat16 through no OpInfo node, and what it rounds
    stays small beside the grads. On the other cases a bfloat16 forward and
    backward hid a halved or zeroed grad in 17 of 21 (counted unjudged:
    drawn, run, judged nothing)."""
    k = Knobs(draw(st.sampled_from(BUCKETS)), not draw(st.booleans()), draw(st.booleans()), not draw(st.booleans()),
              case.exact and draw(BF16))  # bf16 (compared loosely: compare.values.LOW_EPS)
    return case.with_data("deepspeed", None if k == Knobs() else k)


@st.composite
def _misuse(draw, case: Case) -> Case:
    """One misuse (after ``_knobs``), shrinking to the first."""
    return case.with_data("deepspeed", replace(knobs(case), misuse=draw(st.sampled_from(tuple(MISUSES)))))


@st.composite
def _fp16(draw, case: Case) -> Case:
    """fp16 with loss scaling (after ``_knobs``, whose bf16 it replaces), on
    integer-valued cases as bf16 is. Scales stay small (static 1, 8 or 64; a
    dynamic one from 2**2 to 2**6): the default 2**16 overflows the first
    windows of most cases, a skipped window judges nothing, and with static
    scales up to 1024 about one case in 25 overflowed every window (their
    grads reach thousands). A dynamic scale is raised after 1 or 2 steps as
    often as after DeepSpeed's 1000, so the windows that raise it are drawn
    too: the first raise comes at the second step at the earliest, so a case
    has two windows or three."""
    if not case.exact:
        return case
    case = replace(case, schedule=replace(case.schedule, steps=max(case.schedule.steps, draw(st.integers(2, 3)))))
    dynamic = draw(st.booleans())
    k = replace(knobs(case), bf16=False, fp16=True, loss_scale=0 if dynamic else draw(st.sampled_from((1, 8, 64))),
                scale_power=draw(st.integers(2, 6)), scale_window=draw(st.sampled_from((1, 2, 1000))),
                hysteresis=draw(st.sampled_from((2, 1))))
    return case.with_data("deepspeed", k)


KNOBS = Draw("deepspeed", (_knobs,))
FP16 = Draw("deepspeed.fp16", (_fp16,))
MISUSE = Draw("deepspeed.misuse", (_misuse,))
CASE_DATA = DataNamespace("deepspeed", Knobs, {
    "bucket": lambda v, w: sc.integer(v, w, 0, 2**31),
    "contiguous": sc.boolean, "overlap": sc.boolean, "scatter": sc.boolean, "bf16": sc.boolean,
    "misuse": lambda v, w: sc.string(v, w, choices=("", *MISUSES)),
    "fp16": sc.boolean, "loss_scale": lambda v, w: sc.integer(v, w, 0, 2**24),
    "scale_power": lambda v, w: sc.integer(v, w, 0, 24), "scale_window": lambda v, w: sc.integer(v, w, 1, 10**6),
    "hysteresis": lambda v, w: sc.integer(v, w, 1, 100),
})


def pipe_config(case: Case, stage: int) -> dict:
    """The pipeline engine's config: one sample a microbatch, the case's
    microbatches as accumulation steps, ZeRO ``stage`` (0 or 1: the engine
    refuses 2 and 3). Clipping off: DeepSpeed clips to norm 1.0 by default,
    in place, before the optimizer step where these grads are read."""
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": case.schedule.microbatches,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}
