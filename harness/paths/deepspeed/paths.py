"""``deepspeed.zero<N>.stock``: the case's module under a DeepSpeed engine at
ZeRO stage N (0 to 3), with gradient accumulation over the case's
microbatches, on the worker pool's process group (gloo on CPU).
``.manual`` and ``.nosync`` accumulate by hand around the engine, in the two
ways DeepSpeed documents (``rank.DRIVES``).

Grads are compared at every accumulation boundary (and, for stages 0 and
1, after every micro-step: each rank's own running sum), on every rank, against
the float64 eager oracle in DeepSpeed's own convention (mean over ranks and
micro-steps, undone by the grad outputs each rank is given, ``rank``).
Outputs and input grads are compared after every micro-step.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import replace
from typing import Any

from packaging.version import Version

from harness.case.spec import Case
from harness.observation import GRAD_NONE, MISUSE_CLASS, OPTIMIZER_STATE, Observation, Violation
from harness.paths.assemble import observation as assemble
from harness.paths.base import STACK_LOOP, Availability, Contract, Options, Repro
from harness.paths.deepspeed.data import FP16, KNOBS, MISUSE, Knobs, knobs
from harness.paths.engine_rules import engine_owned, exact_mean, replay_only
from harness.paths.pooled import PooledPath, warm_once

STOCK = "stock"
STAGES = (0, 1, 2, 3)
NO_SYNC_STAGES = (0, 1)  # engine.no_sync() refuses the stages that partition grads
TORCH_STAGES = (1, 2, 3)  # loss.backward(): ZeRO 0 raises "Direct calls to tensor.backward() are not supported"
ENGINE_BACKWARD = "engine-backward"  # the workaround of the loss.backward() drive: engine.backward(loss) instead
INSTALL = "pip install 'gradfuzz[deepspeed]'"
# The first release whose engine hooks its outputs so that a plain
# loss.backward() accumulates as engine.backward does (checked in each
# release's runtime/utils.py: 0.18.2 lacks the hooks, 0.18.3 has them).
TORCH_DRIVE_SINCE = Version("0.18.3")
WARM_TIMEOUT = 900.0  # the first compile of DeepSpeed's shared-memory op on a loaded 2-core machine


# ZeRO keeps every parameter's gradient in flat fp32 partitions and
# safe_get_full_grad assembles a parameter's grad from them (DeepSpeed docs,
# "Debugging" in zero3.html: safe_get_full_grad returns the fp32 gradient of
# a parameter, partitioned or not): a parameter that got no grad reads back
# as its slice of the flat buffer, so None versus zeros is not DeepSpeed's to show.
SAFE_GET_FULL_GRAD_BLIND = (GRAD_NONE, "grads are read with deepspeed.utils.safe_get_full_grad, which assembles them "
                            "from ZeRO's flat fp32 gradient partitions (DeepSpeed docs, ZeRO-3 \"Debugging\": "
                            "safe_get_full_grad); those hold a slice for every parameter, used or not")
# The case's training step: the engine refuses it, and so cannot show it.
OWN_OPTIMIZER = ("the engine steps its own optimizer (SGD at learning rate 0 here); the case's training step is not "
                 "drawn for it")
# What the engine's runs cannot show: the rank loop's and its own optimizer.
BLIND = (SAFE_GET_FULL_GRAD_BLIND, *STACK_LOOP, (OPTIMIZER_STATE, OWN_OPTIMIZER))


def installed_release() -> Version:
    """DeepSpeed's release as installed, read from its metadata (importing it takes seconds)."""
    return Version(importlib.metadata.version("deepspeed"))


class DeepSpeedPath(PooledPath):
    # Stage 0 accumulates through eager's AccumulateGrad: where plain
    # .backward() already diverges (accumulategrad-steals-views), so does it.
    contract = Contract(retained_grads=True, draws=(KNOBS,), model_parts=True, judged_against="eager.accumulate",
                        blind=BLIND)

    def __init__(self, name: str, stage: int, impl: str = STOCK, world_size: int = 2, timeout: float = 10.0,
                 backend: str | None = None, drive: str = "auto") -> None:
        super().__init__(name, world_size, timeout, backend)
        self.stage, self.impl, self.drive = stage, impl, drive

    def availability(self) -> Availability:
        if importlib.util.find_spec("deepspeed") is None:
            return Availability(False, f"deepspeed is not installed here: {INSTALL}")
        if self.drive == "torch" and (have := installed_release()) < TORCH_DRIVE_SINCE:
            return Availability(False, f"DeepSpeed {have} has no loss.backward() drive: its output hooks "
                                f"(runtime.utils.register_output_backward_hooks) came in {TORCH_DRIVE_SINCE}", absent=True)
        where = self.group_availability()
        return where if not where.ok else Availability(True, f"{where.reason}; DeepSpeed ZeRO stage {self.stage}")

    def supports(self, case: Case) -> str | None:
        if knobs(case).misuse:
            return (f"the case drives the engine against DeepSpeed's docs ({knobs(case).misuse}): "
                    f"deepspeed.zero{self.stage}.misuse runs it")
        return self._engine_refusal(case)

    def _engine_refusal(self, case: Case) -> str | None:
        return (engine_refusal(case, "at every accumulation boundary") or no_backward(case)
                or exact_mean(case, self._world(), "DeepSpeed divides"))

    def run(self, case: Case) -> Observation:
        warm(self.group)
        outcome = self.group.request({"op": "call", "module": "harness.paths.deepspeed.rank", "case": case.dumps(),
                                      "stage": self.stage, "impl": self.impl, "drive": self.drive}, self.timeout)
        refused = sorted({r["refused"] for r in outcome.replies.values() if isinstance(r, dict) and r.get("refused")})
        if refused:  # DeepSpeed told the user (raised or warned): a refusal, never a finding
            return Observation(self.name, refused=refused[0])
        obs = assemble(self.name, case, outcome)
        obs.violations += skipped_steps(case, outcome.replies)
        for key in ("overflow", "input_overflow"):  # fp16 (``Fp16Path``): what overflowed, by backward
            ks = sorted({s["k"] for r in outcome.replies.values() if isinstance(r, dict)
                         for s in r.get("steps", []) if s.get(key)})
            if ks:
                obs.extra[key] = ks
        obs.precision, obs.rounded = self.rounding(case)
        return obs

    def rounding(self, case: Case) -> tuple[str | None, dict | None]:
        """bf16.enabled: forward and backward in bfloat16, fp32 master grads,
        so compared at bfloat16; what it rounds has no exact account (every
        op of the forward and backward rounds), so against term sizes."""
        return ("bfloat16", None) if knobs(case).bf16 else (None, None)

    def with_workaround(self, name: str) -> Any | None:
        """``engine-backward`` on the ``loss.backward()`` drive: the same case
        with ``engine.backward(loss)`` in its place (the ``auto`` drive, which
        DeepSpeed documents), so a bug of the PyTorch-style backward is told
        by what removes it, not only by its signature."""
        if name != ENGINE_BACKWARD or self.drive != "torch":
            return None
        return DeepSpeedPath(self.name, self.stage, self.impl, self.world_size, self.timeout, self.backend, "auto")

    def repro(self, case: Case) -> Repro:
        if self.impl != STOCK or knobs(case).bf16:  # the script feeds the engine float32 data
            return replay_only(self.name)
        from harness.paths.deepspeed.script import Engine

        return Repro(template="deepspeed", family=Engine(self.stage, self.drive, self._world()))


class MisusePath(DeepSpeedPath):
    """``deepspeed.zero<N>.misuse``: the case's misuse (``data.MISUSES``, drawn
    for these paths only) against the oracle of the documented drive, which
    is what the user meant. A divergence here is a finding of the misuse
    class (``finding_class``): DeepSpeed silently accepted a use it gets
    wrong. One it raises on or warns about is refused (``Observation.extra``)."""

    contract = Contract(retained_grads=True, draws=(KNOBS, MISUSE), model_parts=True,
                        judged_against="eager.accumulate", blind=BLIND)
    finding_class = MISUSE_CLASS

    def use(self, case: Case) -> str:
        """The misuse this case drives (what signs its findings: ``observation.classify``)."""
        return knobs(case).misuse

    def with_workaround(self, name: str) -> Any | None:
        """``documented-drive``: the user's fix, the same case driven as DeepSpeed
        documents (the misuse taken out), so the gate calls a ledger misuse
        known only where that drive agrees (causal, as for any known bug)."""
        return DocumentedDrive(self) if name == DOCUMENTED_DRIVE else None

    def supports(self, case: Case) -> str | None:
        if not knobs(case).misuse:
            return f"no misuse drawn: the documented drives are deepspeed.zero{self.stage}.stock, .manual, .nosync"
        return self._engine_refusal(case)


FP16_STAGES = (0, 1, 2)  # ZeRO 3 keeps its fp16 weights partitioned: _step could not put them back
NO_FP16_HERE = ("fp16 needs DeepSpeed's CUDA accelerator (its CPU accelerator has no fp16): "
                "run it with --backend nccl on GPUs")


class Fp16Path(DeepSpeedPath):
    """``deepspeed.zero<N>.fp16``: the documented drive with fp16 and loss
    scaling (``data.FP16``), on GPUs. A window's grads are what the step
    applied (``rank._step``), compared at fp16's rounding; input grads are
    read over the loss scale, as a user reads them. A window DeepSpeed
    skipped for overflow is judged on nothing, and a case all of whose
    windows overflowed is unjudged."""

    contract = Contract(retained_grads=True, draws=(KNOBS, FP16), model_parts=True, judged_against="eager.accumulate",
                        blind=BLIND)

    def availability(self) -> Availability:
        where = super().availability()
        if where.ok and self.backend_name() != "nccl":
            return Availability(False, NO_FP16_HERE)
        return where

    def supports(self, case: Case) -> str | None:
        if not knobs(case).fp16:
            return "fp16 is not drawn on this case (integer-valued cases only): deepspeed.zero{0,1,2}.stock run it"
        return super().supports(case)

    def run(self, case: Case) -> Observation:
        return judged_at_fp16(case, super().run(case))

    def rounding(self, case: Case) -> tuple[str | None, dict | None]:
        return ("float16", None)

    def repro(self, case: Case) -> Repro:
        return replay_only(self.name)


def judged_at_fp16(case: Case, obs: Observation) -> Observation:
    """What overflowed judges nothing: a window whose step DeepSpeed skipped
    (``rank._step`` marks it), and an input's or retained grad the loss scale
    made pass fp16's range (``rank._unscale``); a case all of whose windows
    were skipped is unjudged, never passed."""
    gas = case.schedule.microbatches
    skipped = {int(k) // gas for k in obs.extra.get("overflow", ())}
    inputs = set(obs.extra.get("input_overflow", ()))
    for st in obs.steps:
        if st.k // gas in skipped:
            st.grads = None  # type: ignore[assignment]
        if st.k // gas in skipped or st.k in inputs:
            st.input_grads, st.retained = None, None  # type: ignore[assignment]
    windows = case.schedule.backwards // gas
    if obs.steps and len(skipped) >= windows:
        obs.extra["unjudged"] = f"every window ({windows}) overflowed fp16 and DeepSpeed skipped its step"
    return obs


DOCUMENTED_DRIVE = "documented-drive"


class DocumentedDrive:
    """A misuse path with ``documented-drive`` in force: its name, contract
    and cases, each run with the misuse taken out (``engine.step()`` after
    every micro-step, ``engine.backward(loss)`` once, nothing zeroed)."""

    def __init__(self, path: MisusePath) -> None:
        self.path, self.name, self.contract = path, path.name, path.contract

    def availability(self) -> Availability:
        return self.path.availability()

    def supports(self, case: Case) -> str | None:
        return self.path.supports(case)

    def run(self, case: Case) -> Observation:
        plain = replace(knobs(case), misuse="")
        return DeepSpeedPath.run(self.path, case.with_data("deepspeed", None if plain == Knobs() else plain))

    def repro(self, case: Case) -> Repro:
        return self.path.repro(case)


def skipped_steps(case: Case, replies: dict[int, Any]) -> list[Violation]:
    """A window that ended without the optimizer stepping (each rank counts
    its optimizer's real steps after the loop's ``engine.step()``): the grads
    read before it may be right and the training still gets nothing, as
    when ``engine.step()`` is called once a window with no boundary set
    (the engine counts that call as one micro-step)."""
    gas = case.schedule.microbatches
    out: list[Violation] = []
    for r in sorted(replies):
        for s in replies[r].get("steps", []) if isinstance(replies[r], dict) else []:
            k, n = s.get("k", -1), s.get("optimizer_steps")
            # A step DeepSpeed skipped for overflow (fp16's dynamic scale) is its documented behaviour.
            if n is not None and k % gas == gas - 1 and n + s.get("skipped", 0) != (k + 1) // gas:
                out.append(Violation("step", k, "optimizer step",
                                     f"rank {r}: window {k // gas} ended after backward {k} and the optimizer has "
                                     f"stepped {n} time(s), not {(k + 1) // gas}: the engine skipped (or added) "
                                     "an update the loop asked for", key="optimizer steps at a window's end"))
                return out  # the first is the finding; the rest follow from it
    return out


def engine_refusal(case: Case, zeroes: str) -> str | None:
    """What neither DeepSpeed engine (ZeRO, pipeline) takes; ``zeroes``
    says when that engine clears .grad."""
    s = case.schedule
    if reason := engine_owned(case, "the engine"):
        return reason
    if s.optimizer or s.clip:
        return OWN_OPTIMIZER
    if s.grad_init != "none" or s.zero_grad == "keep":
        return f"DeepSpeed owns .grad: it starts empty and the engine zeroes it {zeroes}"
    if case.dtype != "float32":
        return "DeepSpeed trains in float32 (or fp16/bf16), not float64"
    return None


NO_BACKWARD = ("no output requires grad: the engine's loop (forward, backward, step) has no backward to call (torch "
               "raises on one), and DeepSpeed's grads exist only between a backward and the step (safe_get_full_grad "
               "raises 'Gradients are only available immediately after backward and before engine step' at ZeRO 1 "
               "and 2; a step after no backward raises at ZeRO 1 to 3, and at ZeRO 0 where it clips)")


def no_backward(case: Case) -> str | None:
    """A case whose outputs need no grad leaves the engine's loop nothing
    DeepSpeed documents: eager runs no backward and reads None, while the
    loop without its backward would read grads and step where DeepSpeed
    keeps none, and its raises there would be the harness's drive, not a
    bug. An output that needs grad through an input alone still runs: the
    user's backward is then the documented one, and what the engine does
    with it is DeepSpeed's."""
    from harness.materialize.stages import requires_grad

    need = requires_grad(case)
    return None if any(need[u.ref] for u in case.outputs) else NO_BACKWARD


def warm(group: Any) -> None:
    """DeepSpeed's first start on a machine compiles a C++ op (tens of
    seconds, minutes under load). That happens here, once per group and
    outside any case's time limit, so a first case is never a false hang.
    Keyed by the ranks' process ids: ranks restarted after a hang load the
    op again (minutes when a loaded machine has another build holding the lock)."""
    warm_once(group, "harness.paths.deepspeed.rank", WARM_TIMEOUT)


def engine_paths(options: Options) -> list[Any]:
    """The ZeRO engine's paths; the family's list adds the pipeline engine's (``pipe.family_paths``)."""

    def made(stage: int, variant: str, drive: str) -> DeepSpeedPath:
        return DeepSpeedPath(f"deepspeed.zero{stage}.{variant}", stage, STOCK, options.world_size,
                             max(options.timeout, 60.0), options.backend, drive)

    misuse = [MisusePath(f"deepspeed.zero{s}.misuse", s, STOCK, options.world_size, max(options.timeout, 60.0),
                         options.backend) for s in STAGES]
    fp16 = [Fp16Path(f"deepspeed.zero{s}.fp16", s, STOCK, options.world_size, max(options.timeout, 60.0),
                     options.backend) for s in FP16_STAGES]
    return ([made(s, STOCK, "auto") for s in STAGES] + [made(s, "manual", "manual") for s in STAGES]
            + [made(s, "nosync", "nosync") for s in NO_SYNC_STAGES] + [made(s, "torch", "torch") for s in TORCH_STAGES]
            + misuse + fp16)
