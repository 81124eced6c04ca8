"""``mesh.*``: 2-D device meshes ("dp", "tp") of 4 ranks.

- ``mesh.fsdp_tp.stock``: tensor parallelism over "tp" (``parallelize_module``
  with ColwiseParallel / RowwiseParallel for weights used as ``h @ w``, every
  other parameter Replicate) composed with FSDP2 ``fully_shard`` over "dp";
  the dp groups get different shares of each grad output, so FSDP2's mean is
  the oracle's grad.
- ``mesh.fsdp_tp.fixed``: ``oracles.mesh_fixed``, the same promise kept with
  plain tensors and all-reduces over the mesh's "tp" and "dp" groups.
- ``mesh.dtensor2d.stock`` / ``.fixed``: parameters as DTensors with a
  placement on each mesh dim, the forward on DTensors; fixed installs
  ``oracles.dtensor_fixed`` as ``dtensor.fixed`` does on one dim.
- ``mesh.pp_dp.stock`` / ``.fixed`` (``PpDpPath``): the same ranks as a
  ("pp", "dp") mesh: two pipeline stages, each under DDP or FSDP2 over "dp",
  in PipelineStage and a schedule over "pp"; fixed is
  ``oracles.mesh_pp_dp_fixed`` (plain send/recv and a dp all-reduce).

Values are compared after every backward (full tensors, assembled by
``harness.paths.assemble``), with the replica rule (every rank sees the
same grad) and the layout rule (``.grad``'s local strides as its
parameter's). The AccumulateGrad placement and collective rules of
``dtensor.*`` are written for one mesh dim and are not applied here
(``PLACEMENT`` is blind).

The group is the worker pool's at world size 4 (``pool.group(4, backend)``),
whatever ``--world-size`` says: the pool is keyed by world size, so it is a
group of its own beside the 2-rank one the other families share (and the
same one with ``--world-size 4``). Under torchrun the paths run only when the
launcher started 4 ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.version import Version

from harness.case.spec import Case
from harness.generate import tp_eligible
from harness.observation import PLACEMENT, Observation
from harness.paths.assemble import observation
from harness.paths import dtensor_rules
from harness.paths.base import (NO_RECOMPUTATION, NO_STEP_AFTER_SCHEDULE, RANK_LOOP, RNG_NOT_COMPARED, Availability,
                                Contract, Options, Repro)
from harness.paths.engine_rules import lifetime_schedule, off_its_devices, replay_only
from harness.paths.mesh.data import DIM_SIZES, STYLES, dp_wrapper, placements, pp_schedule, split
from harness.paths.mesh.redistribute import shard_to_partial
from harness.paths.mesh.data import MESH, PP_DP, min_microbatches
from harness.paths.pooled import PooledPath
from harness.paths.workarounds import IN_PROCESS, WorkedAround

WORLD = 4
STOCK = "stock"
FIXED = {"fsdp_tp": "oracles.mesh_fixed", "dtensor2d": "oracles.dtensor_fixed"}
# A 4-rank case on a loaded machine takes seconds: a hang is told from slowness by a longer wait.
MIN_TIMEOUT = 60.0

# Before 2.13 DTensor cannot redistribute Shard to Partial, which an add can ask for on a 2-d mesh (redistribute.py).
_NO_SHARD_TO_PARTIAL = Version(torch.__version__.split("+")[0]) < Version("2.13")

NOT_2D = (PLACEMENT, "the mesh paths report full values only: the AccumulateGrad placement and collective rules "
                     "are written for a 1-d mesh (dtensor.*)")


class MeshPath(PooledPath):
    contract = Contract(retained_grads=True, draws=(MESH,), model_parts=True,
                        blind=(*RANK_LOOP, NO_RECOMPUTATION, RNG_NOT_COMPARED, NOT_2D))

    def __init__(self, name: str, kind: str, impl: str, timeout: float = 10.0, backend: str | None = None) -> None:
        super().__init__(name, WORLD, max(timeout, MIN_TIMEOUT), backend)
        self.kind = kind
        self.impl = impl
        self.broken = ""  # why the 4-rank group could not start, once it failed to
        # The pool's request carries the gate's workaround to the ranks: the
        # trainer takes the for-loop optimizer; clone-grads reaches parameters
        # the rank makes itself (FSDP2 accumulates into unsharded parameters
        # of its own, which no hook on the sharded ones sees); pp_dp's stage is
        # built with example activations under stage-example-args.
        self.workarounds = {"dtensor2d": IN_PROCESS, "fsdp_tp": ("optimizer-for-loop",),
                            "pp_dp": ("stage-example-args",)}.get(kind, ())

    def availability(self) -> Availability:
        if self.broken:
            return Availability(False, self.broken)
        if self._world() != WORLD:  # before group_availability, which joins torchrun's group
            return Availability(False, f"the mesh paths need {WORLD} ranks (a 2 x 2 mesh); torchrun started "
                                       f"{self._world()}")
        where = self.group_availability()
        if not where.ok:
            return where
        try:
            import importlib

            needs = [("torch.distributed.device_mesh", "init_device_mesh"), ("torch.distributed.tensor", "distribute_tensor")]
            if self.kind == "fsdp_tp":
                needs += [("torch.distributed.fsdp", "fully_shard"), ("torch.distributed.tensor.parallel", "parallelize_module")]
            for module, attr in needs:
                if not hasattr(importlib.import_module(module), attr):
                    raise ImportError(f"{module} has no {attr}")
        except ImportError as e:
            return Availability(False, f"this torch lacks what a 2-D mesh needs ({e})")
        what = "torch as installed" if self.impl == STOCK else self.impl
        return Availability(True, f"{where.reason}, mesh (dp=2, tp=2); {self.kind}: {what}")

    def supports(self, case: Case) -> str | None:
        s = case.schedule
        if reason := lifetime_schedule(case):
            return reason
        if reason := off_its_devices(case, "cuda" if self.backend_name() == "nccl" else "cpu"):
            return reason
        if s.optimizer and s.optimizer_impl == "fused":
            return "fused optimizers have no DTensor sharding strategy on every torch (the parameters are DTensors)"
        if s.optimizer == "rprop":
            return ("rprop on sharded DTensor parameters: its foreach form needs _foreach_copy_, its loop form an "
                    "in-place index_put_, neither with a sharding strategy that keeps the shards")
        if why := dtensor_rules.refusal(case):
            return why
        inplace = dtensor_rules.inplace_ops(case)
        codes = dict(zip((p.name for p in case.params), placements(case)))
        styled = [p.name for p in case.params if split(codes[p.name])[1] in STYLES]
        if any(not tp_eligible(case, n) for n in styled):
            return "a tensor-parallel style needs a weight used only as the right operand of a matmul (h @ w)"
        unused = _unused_output(case)
        if unused:
            return (f"an output of a multi-output {unused} is unused: torch materializes its missing grad as a plain "
                    f"tensor, not a DTensor, and the backward mixes the two (a Function's raises, see cases/dtensor/; "
                    f"chunk's cat raises 'got mixed torch.Tensor and DTensor' on 2.13, on the fixed paths too: "
                    f"cases/pipeline/inner_chunk_output_stride_mismatch.json)")
        sharded = styled if self.kind == "fsdp_tp" else [n for n, c in codes.items() if c != "R,R"]
        if inplace and sharded:
            return (f"{', '.join(inplace)} in place with sharded parameters: a value can be Partial (sum, or avg "
                    f"from a mean over a sharded dim), and DTensor refuses in-place ops that would change it ('in-place "
                    f"operations that require placement changes are not supported', raised on 2.13 on the fixed path too)")
        if why := dtensor_rules.uneven_view(case, sharded):
            return why
        if self.kind == "dtensor2d":
            return _dtensor2d_refusal(case, codes, self.impl)
        return None

    def run(self, case: Case) -> Observation:
        from harness.workers.pool import PoolError

        try:
            outcome = self.group.request({"op": "call", "module": "harness.paths.mesh.rank", "case": case.dumps(),
                                          "kind": self.kind, "impl": self.impl}, self.timeout)
        except PoolError as e:
            self.broken = f"the {WORLD}-rank process group did not start here: {e}"[:2000]
            raise
        return observation(self.name, case, outcome)

    def repro(self, case: Case) -> Repro:
        return replay_only(self.name)


def _thin(case: Case, codes: dict[str, str]) -> set[str]:
    """Parameters some dim of which has fewer elements than the mesh ranks that shard it."""
    out = set()
    for p in case.params:
        dp, tp = split(codes[p.name])
        tp = {"colwise": "S1", "rowwise": "S0"}.get(tp, tp)
        ways: dict[int, int] = {}
        for part in (dp, tp):
            if part.startswith("S"):
                ways[int(part[1:])] = ways.get(int(part[1:]), 1) * 2
        if any(p.shape[d] < n for d, n in ways.items()):
            out.add(p.name)
    return out


def _unused_output(case: Case) -> str:
    """The op of a live multi-output node (a custom Function's ``pair``, ``chunk``)
    one of whose results no live node or output uses ("" if none)."""
    from harness.case.validate import infer_shapes

    shapes = infer_shapes(case)
    live: set[str] = {u.ref for u in case.outputs}
    used: set[tuple[str, Any]] = {(u.ref, u.index) for u in case.outputs}
    for node in reversed(case.nodes):
        if node.name in live:
            for u in node.args:
                live.add(u.ref)
                used.add((u.ref, u.index))
    for n in case.nodes:
        shape = shapes.get(n.name)
        if n.name in live and shape and isinstance(shape[0], tuple):
            if not {(n.name, i) for i in range(len(shape))} <= used:
                return n.op
    return ""


NOT_2D_PP = (PLACEMENT, "mesh.pp_dp reports full values only (each stage's grads put together over \"dp\"): the "
                        "AccumulateGrad placement and collective rules are written for a 1-d mesh (dtensor.*)")


class _DdpStagesOnly(WorkedAround):
    """mesh.pp_dp with clone-grads: the hooks sit on a DDP stage's parameters,
    which the rank makes; an FSDP2 stage accumulates into unsharded
    parameters of its own that no hook on them sees, so its cases are
    outside this worked-around path (the gate then says so)."""

    def supports(self, case: Case) -> str | None:
        if dp_wrapper(case) != "ddp":
            return "clone-grads reaches a DDP stage's parameters only, not FSDP2's unsharded ones"
        return self.path.supports(case)


class PpDpPath(MeshPath):
    """``mesh.pp_dp.*``: two pipeline stages over "pp", each replicated (DDP)
    or sharded (FSDP2) over "dp" (``harness.paths.mesh.pp_dp``)."""

    contract = Contract(retained_grads=False, draws=(PP_DP,), model_parts=True, random_ops=False,
                        blind=(*RANK_LOOP, NO_RECOMPUTATION, RNG_NOT_COMPARED, NOT_2D_PP, NO_STEP_AFTER_SCHEDULE))

    def with_workaround(self, name: str) -> Any | None:
        return _DdpStagesOnly(self, name) if name == "clone-grads" else None

    def availability(self) -> Availability:
        if self.broken:
            return Availability(False, self.broken)
        if self._world() != WORLD:
            return Availability(False, f"mesh.pp_dp needs {WORLD} ranks (a 2 x 2 mesh); torchrun started "
                                       f"{self._world()}")
        where = self.group_availability()
        if not where.ok:
            return where
        try:
            import importlib

            import numpy  # noqa: F401  (stages on several ranks exchange shapes with send_object_list)

            for module, attr in [("torch.distributed.device_mesh", "init_device_mesh"),
                                 ("torch.distributed.pipelining", "PipelineStage"),
                                 ("torch.distributed.pipelining", "ScheduleGPipe"),
                                 ("torch.distributed.pipelining", "Schedule1F1B"),
                                 ("torch.distributed.fsdp", "fully_shard"),
                                 ("torch.nn.parallel", "DistributedDataParallel")]:
                if not hasattr(importlib.import_module(module), attr):
                    raise ImportError(f"{module} has no {attr}")
        except ImportError as e:
            return Availability(False, f"this torch lacks what pipeline x data parallel needs ({e})")
        what = "PipelineStage over DDP / FSDP2 as installed" if self.impl == STOCK else self.impl
        return Availability(True, f"{where.reason}, mesh (pp=2, dp=2); pp_dp: {what}")

    def supports(self, case: Case) -> str | None:
        from harness.case.ops import draws_random
        from harness.materialize.stages import cut, requires_grad
        from harness.paths.mesh.pp_dp import stage_cuts

        s = case.schedule
        if reason := lifetime_schedule(case):
            return reason
        if s.clip or s.optimizer:
            return f"{NO_STEP_AFTER_SCHEDULE[1]} (as pipeline.*)"
        if any(len(x.shape) == 0 for x in case.inputs):
            return "an input without a batch dim cannot be split into microbatches"
        if draws_random(case):
            return ("dropout: the schedule runs the microbatches' forwards in its own order on its own RNG stream, "
                    "so masks cannot match the case's (no RNG replay across stages in torch.distributed.pipelining)")
        stages = len(stage_cuts(case)) + 1
        if stages != DIM_SIZES[0]:
            return f"mesh.pp_dp runs {DIM_SIZES[0]} pipeline stages (one per pp rank), the case has {stages}"
        schedule = pp_schedule(case)
        if s.microbatches < min_microbatches(schedule):
            return (f"Schedule{schedule} refuses fewer microbatches than stages ({s.microbatches} < {stages}: its "
                    f"constructor raises)")
        need = requires_grad(case)
        if not any(need[u.ref] for u in case.outputs):
            return "no output requires grad (nothing for the schedule to train)"
        if dp_wrapper(case) == "ddp":
            frozen = {p.name for p in case.params if not p.requires_grad}
            for spec in cut(case, stage_cuts(case)):
                if all(n in frozen for n in spec.params):
                    return (f"stage {spec.index} has no parameter that requires grad: DistributedDataParallel "
                            f"refuses such a module (\"DistributedDataParallel is not needed when a module doesn't "
                            f"have any parameter that requires a gradient\")")
        return None

    def run(self, case: Case) -> Observation:
        from harness.workers.pool import PoolError

        try:
            outcome = self.group.request({"op": "call", "module": "harness.paths.mesh.rank", "case": case.dumps(),
                                          "kind": self.kind, "impl": self.impl}, self.timeout)
        except PoolError as e:
            self.broken = f"the {WORLD}-rank process group did not start here: {e}"[:2000]
            raise
        if any(isinstance(r, dict) and (r.get("failure") or "error" in r) for r in outcome.replies.values()):
            # A rank that raised mid-schedule leaves sends and receives on the
            # "pp" group unmatched (a peer's recv, PipelineStage's posted
            # irecvs): the next case's messages would pair with them (a fixed
            # case hung after a stock one raised, gloo). Fresh ranks, and so
            # fresh sub-groups, for the next case (on NCCL too, as pipeline.*).
            self.group.close()
        return pp_dp_observation(self.name, case, outcome)


def _dtensor2d_refusal(case: Case, codes: dict[str, str], impl: str) -> str | None:
    """What only the 2-D DTensor paths refuse: a redistribution this torch
    cannot do, and parameters sharded thinner than their ranks."""
    s = case.schedule
    at = shard_to_partial(case, impl) if _NO_SHARD_TO_PARTIAL else None
    if at:
        return (f"DTensor would redistribute a Shard into a Partial, which this torch cannot do (a dry run "
                f"on a fake group raised at {at}; harness/paths/mesh/redistribute.py); 2.13 can")
    thin = _thin(case, codes)
    writes = (s.grad_init != "none" or s.microbatches > 1 or s.optimizer or s.clip
              or (s.steps > 1 and s.zero_grad != "set_to_none"))
    expanded = {u.ref for n in case.nodes if n.op == "expand" for u in n.args}
    if thin & expanded:
        return (f"expand of {', '.join(sorted(thin & expanded))}, sharded on a dim with fewer elements than "
                f"the ranks that shard it: DTensor's sharding propagation raises a bare KeyError (torch bug, "
                f"seen on 2.13 on one mesh dim: _rewrite_plain_shard)")
    if thin and writes:
        return (f"{', '.join(sorted(thin))} sharded on a dim with fewer elements than the ranks that shard it: "
                f"DTensor has no in-place strategy for it, so accumulating into its .grad raises (torch bug, "
                f"see cases/dtensor/)")
    return None


def _orphans(case: Case, held: set[str]) -> dict[str, Any]:
    """A parameter no stage uses belongs to no stage: its .grad is what it started as (as pipeline.* has it)."""
    from harness.materialize.tensors import Built

    init = case.schedule.grad_init
    out: dict[str, Any] = {}
    for p in case.params:
        if p.name not in held:
            out[p.name] = None if init == "none" or not p.requires_grad else \
                torch.zeros(p.shape, dtype=torch.float64) if init == "zero" else Built(case).prefill()[p.name]
    return out


def pp_dp_observation(name: str, case: Case, outcome: Any) -> Observation:
    """Rank facts -> one Observation: a Step per microbatch; parameter grads
    at the last microbatch of each ``step()`` (a schedule interleaves a
    step's microbatches), each stage's put together over its dp replicas
    (the replica rule), copies of a tied weight summed over stages; input
    grads from the first stage's replicas (each its own, the mean is the
    grad), outputs from the last stage's (replicas)."""
    from harness.observation import Failure
    from harness.paths.assemble import _first_failure, _judge_layout

    obs = Observation(path=name)
    obs.extra["seconds"] = outcome.seconds
    replies = outcome.replies
    _first_failure(obs, replies)
    _judge_group(obs, outcome)
    ranks = sorted(replies)
    if outcome.status != "ok" or len(ranks) != WORLD or any("steps" not in replies[r] for r in ranks):
        if outcome.status == "ok" and obs.failure is None:
            obs.failure = Failure(-1, "WorkerError", "not every rank replied")
        return obs
    stages: dict[int, list[int]] = {}
    for r in ranks:
        stages.setdefault(int(replies[r].get("pp", r // DIM_SIZES[1])), []).append(r)
    M = case.schedule.microbatches
    n_steps = min(len(replies[r]["steps"]) for r in ranks)
    if len({len(replies[r]["steps"]) for r in ranks}) > 1 and obs.failure is None:
        obs.failure = Failure(n_steps * M, "WorkerError", "ranks completed different numbers of steps")
    problems: set[str] = set()
    held = {n for r in ranks for rec in replies[r]["steps"][:1] for n in rec["grads"]}
    orphan = _orphans(case, held) if n_steps else {}
    for s in range(n_steps):
        recs = {r: replies[r]["steps"][s] for r in ranks}
        grads = {**_step_grads(obs, problems, case, stages, recs, s * M + M - 1), **orphan}
        for r in ranks:
            _judge_layout(obs, problems, s * M + M - 1, r, recs[r].get("layout", {}))
        for j in range(M):
            obs.steps.append(_microbatch(obs, problems, case, recs, stages, s * M + j, j,
                                         dict(grads) if j == M - 1 else None))
    return obs


def _judge_group(obs: Observation, outcome: Any) -> None:
    """A hang or a dead rank, as a violation of the whole group."""
    from harness.observation import Violation

    if outcome.status == "timeout" and obs.failure is not None:
        # A rank raised mid-schedule and its pp peer waits for ever on a recv
        # it will not get: the raise is the finding, the wait its consequence
        # (as pipeline.* judges it). Only a wait with no raise is a hang.
        obs.extra["peers_waited"] = outcome.detail[:2000]
    elif outcome.status == "timeout":
        obs.violations.append(Violation("timeout", -1, "process group",
                                        f"the case hung (a rank waiting on a send, recv or collective): "
                                        f"{outcome.detail}", key="timeout"))
    elif outcome.status == "crash":
        obs.violations.append(Violation("crash", -1, "process group",
                                        f"a rank died running the case: {outcome.detail}", key="crash"))


def _step_grads(obs: Observation, problems: set[str], case: Case, stages: dict[int, list[int]],
                recs: dict[int, Any], end: int) -> dict[str, Any]:
    """One step's parameter grads: each stage's over its dp replicas, a tied weight's copies summed."""
    from harness.paths.assemble import _assemble

    grads: dict[str, Any] = {p.name: None for p in case.params}
    for st in sorted(stages):
        rs = stages[st]
        for n in recs[rs[0]]["grads"]:
            v = _assemble(obs, problems, end, n, [recs[r]["grads"].get(n) for r in rs], len(rs))
            if v is not None:
                grads[n] = v if grads[n] is None else grads[n] + v
    return grads


def _microbatch(obs: Observation, problems: set[str], case: Case, recs: dict[int, Any],
                stages: dict[int, list[int]], k: int, j: int, grads: dict[str, Any] | None) -> Any:
    """Microbatch ``j`` of the step (backward ``k``): input grads from the
    first stage's replicas, outputs from the last's, ``grads`` at a step's end."""
    from harness.observation import Step
    from harness.paths.assemble import _assemble

    firsts, lasts = stages[min(stages)], stages[max(stages)]
    in_grads = {}
    for x in case.inputs:
        encs = [(recs[r].get("input_grads") or {}).get(x.name) for r in firsts]
        in_grads[x.name] = _assemble(obs, problems, k, f"input grad {x.name}",
                                     [None if e is None else e[j] for e in encs], len(firsts))
    seen = [(recs[r].get("outputs") or {}).get(str(k)) or [] for r in lasts]
    outputs = [_assemble(obs, problems, k, f"output {i}", [e[i] if i < len(e) else None for e in seen], len(lasts))
               for i in range(max((len(e) for e in seen), default=0))]
    return Step(k=k, grads=grads, input_grads=in_grads, outputs=outputs)  # type: ignore[arg-type]


PP_DP_FIXED = "oracles.mesh_pp_dp_fixed"


def paths(options: Options) -> list[MeshPath]:
    """The registry's hook: six paths on one 4-rank group."""
    t, b = options.timeout, options.backend
    return [MeshPath(f"mesh.{kind}.{variant}", kind, STOCK if variant == "stock" else FIXED[kind], t, b)
            for kind in ("fsdp_tp", "dtensor2d") for variant in ("stock", "fixed")] + \
        [PpDpPath(f"mesh.pp_dp.{variant}", "pp_dp", STOCK if variant == "stock" else PP_DP_FIXED, t, b)
         for variant in ("stock", "fixed")]
