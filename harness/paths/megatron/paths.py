"""``megatron.ddp.stock`` and ``megatron.distopt.stock``: the case's module
under megatron-core's ``DistributedDataParallel`` (contiguous grad buffers,
``param.main_grad``), reducing by all-reduce or, for the distributed
optimizer, by reduce-scatter, with gradient accumulation over the case's
microbatches, on the worker pool's process group (gloo on CPU).

``main_grad`` is compared after every backward, on every rank, against the
float64 eager oracle in megatron's convention (mean over ranks and
micro-steps, undone by the grad outputs each rank is given, ``rank``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

from harness.case.spec import Case
from harness.observation import GRAD_NONE, OPTIMIZER_STATE, Observation
from harness.paths.assemble import observation as assemble
from harness.paths.base import STACK_LOOP, Availability, Contract, Options, Repro
from harness.paths.engine_rules import engine_owned, exact_mean, replay_only
from harness.paths.megatron.data import KNOBS, PP_KNOBS, VPP_KNOBS, groups, knobs
from harness.paths.pooled import PooledPath

STOCK = "stock"
INSTALL = "pip install 'gradfuzz[megatron]'"
REDUCES = {"ddp": False, "distopt": True}  # path name -> use_distributed_optimizer


def installed() -> bool:
    """Is megatron-core importable here (``megatron`` alone may be another package's namespace)."""
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


# The case's training step: refused, and so not shown.
CUDA_OPTIMIZERS = ("megatron's optimizers check for CUDA tensor types and do not run on a CPU; the case's "
                   "training step is not run for it")


class MegatronPath(PooledPath):
    # Each micro-step's grad reaches main_grad through eager's AccumulateGrad
    # (megatron's hook adds param.grad, then clears it): where plain
    # .backward() already diverges, so does it.
    contract = Contract(retained_grads=True, draws=(KNOBS,), gap_cases=True, model_parts=True,
                        judged_against="eager.accumulate",
                        blind=((GRAD_NONE, "grads are read from param.main_grad, a view into the contiguous grad "
                                "buffer megatron's DistributedDataParallel keeps for every trainable parameter "
                                "(megatron-core API docs, core.distributed.distributed_data_parallel: \"DDP wrapper "
                                "which stores grads in contiguous buffers\"), so an unused parameter's grad is a "
                                "zero slice by design, never None"), *STACK_LOOP,
                               (OPTIMIZER_STATE, CUDA_OPTIMIZERS)))

    def __init__(self, name: str, distopt: bool, impl: str = STOCK, world_size: int = 2, timeout: float = 10.0,
                 backend: str | None = None) -> None:
        super().__init__(name, world_size, timeout, backend)
        self.distopt, self.impl = distopt, impl

    def availability(self) -> Availability:
        if not installed():
            return Availability(False, f"megatron-core is not installed here: {INSTALL}")
        where = self.group_availability()
        what = "reduce-scatter (distributed optimizer)" if self.distopt else "all-reduce"
        return where if not where.ok else Availability(True, f"{where.reason}; megatron-core DDP, {what}")

    def supports(self, case: Case) -> str | None:
        return megatron_refusal(case, "megatron's DDP") or exact_mean(case, self._world(), "megatron averages")

    def run(self, case: Case) -> Observation:
        outcome = self.group.request({"op": "call", "module": "harness.paths.megatron.rank", "case": case.dumps(),
                                      "distopt": self.distopt, "impl": self.impl}, self.timeout)
        return assemble(self.name, case, outcome)

    def with_workaround(self, name: str) -> Any | None:
        """``no-overlap-grad-reduce``: the same case with ``overlap_grad_reduce``
        off, what a user does when its bucket bookkeeping fails, so the gate
        can tell that bug by what removes it."""
        return Reknobbed(self, name) if name == NO_OVERLAP else None

    def repro(self, case: Case) -> Repro:
        if self.impl != STOCK:  # a canary's fault is not megatron's: replayed, never scripted
            return replay_only(self.name)
        from harness.paths.megatron.script import Ddp

        return Repro(template="megatron", family=Ddp(self.distopt, self._world()))


def megatron_refusal(case: Case, engine: str) -> str | None:
    """What neither megatron path (DDP, pipeline) takes; ``engine`` names the one asking."""
    s = case.schedule
    if reason := engine_owned(case, engine):
        return reason
    if s.optimizer or s.clip:
        return CUDA_OPTIMIZERS
    if s.grad_init != "none" or s.zero_grad == "keep":
        return ("megatron accumulates in main_grad, which zero_grad_buffer() must clear at the start of every "
                "iteration (documented); .grad is a transient its hook adds and clears")
    if knobs(case).fp32_reduce and case.dtype != "float32":
        return f"grad_reduce_in_fp32 holds a {case.dtype} model's grads in float32, below the case's precision"
    return None


PP_STAGES = 2


class MegatronPipePath(PooledPath):
    """``megatron.pp.stock``: the case cut into two stages on two ranks,
    megatron's non-interleaved 1F1B schedule over them
    (``forward_backward_pipelining_without_interleaving``) and its
    ``finalize_model_grads``, which all-reduces the shared weight's grad over
    the embedding group (``harness.paths.megatron.pipe.rank``)."""

    contract = Contract(retained_grads=False, draws=(PP_KNOBS,), gap_cases=True, model_parts=True,
                        random_ops=False, judged_against="eager.accumulate", blind=MegatronPath.contract.blind)
    chunks = 1  # model chunks per rank (virtual pipeline size; 1: none)

    def __init__(self, name: str, impl: str = STOCK, timeout: float = 10.0, backend: str | None = None) -> None:
        super().__init__(name, PP_STAGES, timeout, backend)
        self.impl = impl

    def _what(self) -> str:
        return f"megatron-core 1F1B pipeline, {PP_STAGES} stages, shared embedding all-reduce"

    def availability(self) -> Availability:
        if not installed():
            return Availability(False, f"megatron-core is not installed here: {INSTALL}")
        where = self.group_availability()
        if where.ok and self._world() != PP_STAGES:
            return Availability(False, f"{self.name} runs {PP_STAGES} pipeline ranks; this group has {self._world()}")
        return where if not where.ok else Availability(True, f"{where.reason}; {self._what()}")

    def _cut_refusal(self, case: Case) -> str | None:
        if not knobs(case).cut:
            return f"no pipeline cut (family.megatron.cut): megatron.pp runs {PP_STAGES} stages"
        return None

    def _schedule_refusal(self, case: Case) -> str | None:
        return None

    def supports(self, case: Case) -> str | None:
        from harness.case.ops import draws_random
        from harness.materialize.stages import requires_grad
        from harness.paths.megatron.pipe.rank import held_apart, shared_params, stage_specs

        s = case.schedule
        if reason := megatron_refusal(case, "megatron's pipeline"):
            return reason
        k = knobs(case)
        if k.per_token and s.microbatches & (s.microbatches - 1):
            return (f"calculate_per_token_loss scales the grads by 1 / {s.microbatches} tokens computed in float32 "
                    f"(1.0 / an int tensor), which is not the case's precision")
        if reason := self._cut_refusal(case) or self._schedule_refusal(case):
            return reason
        if draws_random(case):
            return ("dropout: each stage runs on its own rank and RNG stream, so masks cannot match the case's "
                    "(megatron's tensor-parallel RNG tracker is not part of this path)")
        specs = stage_specs(case, self.chunks)
        shared = shared_params(case, specs)
        if len(shared) > 1:
            return (f"{len(shared)} parameters ({', '.join(shared)}) are used by both stages: megatron shares one "
                    f"weight across pipeline stages, the word embedding / output layer "
                    f"(shared_embedding_or_output_weight(); finalize_model_grads all-reduces only it)")
        last = len(specs) - 1
        apart = {n: at for n, at in held_apart(case, specs).items() if at != [0, last]}
        if apart:
            n, at = next(iter(apart.items()))
            return (f"{n} is used by stages {at}: megatron shares one weight across pipeline stages, the word "
                    f"embedding on the first stage and the output layer on the last (stages 0 and {last}; "
                    f"finalize_model_grads all-reduces only them, over the embedding group)")
        if empty := [spec.index for spec in specs[1:] if not spec.inputs]:
            return (f"nothing crosses the cut into stage {empty[0]}: megatron's schedule sends each stage's output "
                    f"to the next")
        need = requires_grad(case)
        if not any(need[u.ref] for u in case.outputs):
            return "no output requires grad (nothing for the schedule to train)"
        return exact_mean(case, 1, "megatron divides each microbatch's loss")

    def run(self, case: Case) -> Observation:
        outcome = self.group.request({"op": "call", "module": "harness.paths.megatron.pipe.rank", "case": case.dumps(),
                                      "impl": self.impl, "chunks": self.chunks}, self.timeout)
        obs = assemble(self.name, case, outcome)
        if obs.failure is not None and obs.failure.type != "WorkerError":
            # A stage that raised leaves its peer waiting in a p2p recv or the
            # embedding all-reduce for ever: the raise is the finding, the
            # peer's wait its consequence (the pipeline family's rule). Only
            # a wait with no rank raising is a hang.
            obs.violations = [v for v in obs.violations if v.kind != "timeout"]
        return obs

    def repro(self, case: Case) -> Repro:
        if self.impl != STOCK:  # a canary's fault is not megatron's: replayed, never scripted
            return replay_only(self.name)
        from harness.paths.megatron.pipe.script import Pipe

        return Repro(template="megatron.pipe", family=Pipe(self.chunks))

    def with_workaround(self, name: str) -> Any | None:
        """``paired-p2p``: the same case with ``batch_p2p_comm`` off, the fix
        megatron's maintainers give for pipeline size 2 (NVIDIA/Megatron-LM#750),
        so the gate can tell that bug by what removes it; ``no-overlap-grad-reduce``
        as on the DDP paths (each stage's DDP takes the case's knobs)."""
        return Reknobbed(self, name) if name in KNOBS_OF else None


PAIRED_P2P = "paired-p2p"
NO_OVERLAP = "no-overlap-grad-reduce"
# The case's knobs each workaround sets. paired-p2p leaves overlap_p2p off, which needs batch_p2p off already;
# no-overlap-grad-reduce drops the bucket size too, which megatron reads only with overlap_grad_reduce.
KNOBS_OF: dict[str, dict[str, Any]] = {PAIRED_P2P: {"batch_p2p": False}, NO_OVERLAP: {"overlap": False, "bucket": 0}}


class Reknobbed:
    """A megatron path with one of its workarounds (``KNOBS_OF``) in force:
    its name, contract and cases, each run with the knobs the workaround sets."""

    def __init__(self, path: Any, workaround: str) -> None:
        self.path, self.name, self.contract = path, path.name, path.contract
        self.changes = KNOBS_OF[workaround]

    def availability(self) -> Availability:
        return self.path.availability()

    def _changed(self, case: Case) -> Case:
        return case.with_data("megatron", replace(knobs(case), **self.changes))

    def supports(self, case: Case) -> str | None:
        return self.path.supports(self._changed(case))

    def run(self, case: Case) -> Observation:
        return self.path.run(self._changed(case))

    def repro(self, case: Case) -> Repro:
        return self.path.repro(case)


VPP_CHUNKS = 2


class MegatronVppPath(MegatronPipePath):
    """``megatron.vpp.stock``: the case cut into four virtual stages, two
    model chunks on each of two ranks (stage ``s`` is chunk ``s // 2`` of
    rank ``s % 2``), under megatron's interleaved 1F1B schedule
    (``forward_backward_pipelining_with_interleaving``), the shared weight on
    the first chunk of the first rank and the last chunk of the last, and
    ``finalize_model_grads`` over both chunks of each rank
    (``harness.paths.megatron.pipe.rank``)."""

    contract = Contract(retained_grads=False, draws=(VPP_KNOBS,), gap_cases=True, model_parts=True,
                        random_ops=False, judged_against="eager.accumulate", blind=MegatronPath.contract.blind)
    chunks = VPP_CHUNKS

    def _what(self) -> str:
        return (f"megatron-core interleaved 1F1B pipeline, {PP_STAGES} ranks x {VPP_CHUNKS} model chunks, shared "
                f"embedding all-reduce")

    def _cut_refusal(self, case: Case) -> str | None:
        n = PP_STAGES * VPP_CHUNKS
        if len(knobs(case).cuts) != n - 1:
            return (f"{len(knobs(case).cuts)} cuts (family.megatron.cuts): megatron.vpp runs {n} virtual stages, "
                    f"{PP_STAGES} ranks x {VPP_CHUNKS} model chunks, so it needs {n - 1}")
        return None

    def _schedule_refusal(self, case: Case) -> str | None:
        # megatron/core/pipeline_parallel/schedules.py, forward_backward_pipelining_with_interleaving: "The number
        # of contiguous micro-batches in a virtual pipeline stage should range in [PP, M]" (ValueError) and "The
        # remainder of M ... divided by N ... should be 0, or larger than or equal to the pipeline-parallel size"
        # (RuntimeError); N is ModelParallelConfig.microbatch_group_size_per_vp_stage, by default the pipeline size.
        k = knobs(case)
        if k.deallocate and k.overlap_p2p and self.backend_name() == "gloo":
            # Checked by hand on two fuzzed cases: either knob off and they agree; both on, the receiver sees freed
            # memory (values like 1e26).
            return ("deallocate_pipeline_outputs with overlap_p2p_comm on gloo: the schedule frees the sent output "
                    "(deallocate_output_tensor sets .data) right after posting its isend and waits for the send "
                    "later; on CUDA ProcessGroupNCCL records the send on its stream, so the caching allocator keeps "
                    "the block until it is sent, but gloo reads the storage when the send runs, after it was freed "
                    "(the CPU run's artifact; not checked on a GPU here)")
        m, group = case.schedule.microbatches, k.group
        if group not in groups(m, PP_STAGES):
            n = group or PP_STAGES
            return (f"megatron's interleaved schedule raises for {m} microbatches in groups of {n} "
                    f"(microbatch_group_size_per_vp_stage; default the pipeline size, {PP_STAGES}): the group must "
                    f"be in [{PP_STAGES}, {m}] and {m} % {n} must be 0 or at least {PP_STAGES} "
                    f"(forward_backward_pipelining_with_interleaving, megatron/core/pipeline_parallel/schedules.py)")
        return None


def paths(options: Options) -> list:
    return [MegatronPath(f"megatron.{kind}.stock", distopt, STOCK, options.world_size, max(options.timeout, 60.0),
                         options.backend) for kind, distopt in REDUCES.items()] + \
        [MegatronPipePath("megatron.pp.stock", STOCK, max(options.timeout, 60.0), options.backend),
         MegatronVppPath("megatron.vpp.stock", STOCK, max(options.timeout, 60.0), options.backend)]
