"""``pipeline.<schedule>.*``: staged cases through ``PipelineStage`` and torch's schedules.

The split functions are half of what a pipeline-parallel user runs; the
stage and its schedule decide what is detached, which buffers are reused,
which hooks fire and when input and weight grads are computed. So the case
is cut into stages (the family's ``Stages``, ``harness.materialize.stages``), each an
``nn.Module`` owning copies of its parameters, and every schedule the
installed torch exports runs it through ``schedule.step()``, one call per
step of the case (``harness.paths.pipeline.rank`` has what a rank does).

Path names: ``pipeline.<schedule>.stock`` and ``.fixed`` hold every stage
in one process (gloo, world size 1); ``pipeline.<schedule>.ranks2.stock``
and ``.fixed`` put the stages on two ranks, as the schedule places them.
Stock is ``PipelineStage`` as installed; fixed is
``oracles.pipeline_fixed.FixedPipelineStage`` (its backward counts each use
site once and detaches nothing W needs), so a divergence on stock alone is
the split functions' or the stage's, and on both the schedule's.

Which layouts a schedule takes (how many stages, how many microbatches,
which rank holds which stage) is found by constructing it on the ranks
(``pipeline_rank.probe``), not from a table; fuzzing draws only those
(``PipelinePath.layouts``, drawn by ``data.layout_draw``), and a case outside them is skipped.
One more probe, one step of two stages on one rank (``pipeline_rank.same_rank_p2p``,
per stage class, on a group of one rank with the backend the cases of that
world size run on), finds a runtime that sends between a rank's own stages
through the process group (torch 2.11's ``_initialize_stages`` warm-up;
gloo has no pair to itself): there, layouts with two adjacent stages on one
rank (every multi-stage layout in one process, the V placement on two
ranks) are outside that stage class's contract, with that reason. The
fixed stage leaves its own rank out of the warm-up (as 2.13 does), so on
2.11 only stock loses those layouts.

Observable: parameter grads only after each ``step()`` (a schedule
interleaves the microbatches of a step, so there is no moment "after
backward k" for the whole model); they are the sum of a parameter's
copies. Per microbatch: what the loss function was handed (the last
stage's outputs) and the grad each stacked input got, by rows. A grad the
user holds, an input or the target that changes, an exception, a hang or a
dead rank are findings, as on every path.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any

import torch

from harness.observation import HOOK_FIRING, Failure, Grads, Mutation, Observation, Step, Violation
from harness.paths.engine_rules import lifetime_schedule, off_its_devices
from harness.paths.base import (NO_PARAM_HOOKS, NO_RECOMPUTATION, NO_STEP_AFTER_SCHEDULE, PLAIN_GRADS, Availability,
                                Contract, Options, Repro)
from harness.paths.pipeline.data import Machinery, stage_cuts
from harness.paths.pipeline.data import layout_draw
from harness.case.spec import Case

FIXED = "oracles.pipeline_fixed:FixedPipelineStage"
STOCK = "stock"
LAYOUTS = {1: "", 2: "ranks2."}  # world size -> the infix in path names




_probed: dict[tuple[int, str | None], dict[str, Any]] = {}


def pool_backend(world_size: int) -> str:
    from harness.workers import pool

    return pool.backend_for(world_size)


def _group(world_size: int, backend: str | None = None) -> Any:
    """The pool of this world size and backend (``--backend``; None: NCCL with
    a GPU per rank, else gloo), shared with the other process-group families."""
    from harness.workers import pool

    return pool.group(world_size, backend)


# A group's ranks, by the pool start they belong to, whose p2p group is built and used once.
_warmed: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
WARM_TIMEOUT = 120.0


def _warm(group: Any, wait: float) -> None:
    """Build fresh ranks' p2p group and its communicators in a request of
    their own, outside any case's time limit.

    NCCL makes a communicator on its first use, and on NCCL the ranks are
    replaced after every case that raised: the next case paid for the new
    group inside its 10 s. On four loaded GPUs the fixed path after a raising
    stock case hung past that (a false finding on
    pipeline.InterleavedZeroBubble.ranks2.fixed in the gate); alone, the same
    pair takes 1.6 s instead of 0.01 s."""
    if getattr(group, "starts", None) is None or (group.alive and _warmed.get(group) == group.starts):
        return
    group.request({"op": "call", "module": "harness.paths.pipeline.rank", "what": "warm", "wait": wait},
                  WARM_TIMEOUT)
    _warmed[group] = group.starts


def _ask(world_size: int, msg: dict[str, Any], what: str, timeout: float, backend: str | None = None) -> dict[str, Any]:
    """Rank 0's reply to a ``pipeline_rank.handle`` message, or why ``what`` failed."""
    outcome = _group(world_size, backend).request({"op": "call", "module": "harness.paths.pipeline.rank", **msg},
                                                  timeout)
    reply = outcome.replies.get(0, {})
    if outcome.status != "ok" or "error" in reply:
        raise RuntimeError(f"probing {what} on {world_size} rank(s) failed: "
                           f"{reply.get('error') or outcome.detail or outcome.status}")
    return reply


def probe(world_size: int, timeout: float = 120.0, backend: str | None = None) -> dict[str, Any]:
    """The layouts of every schedule with this many ranks (cached per process and backend)."""
    if (world_size, backend) not in _probed:
        inherited = _inherited("probe", (world_size, backend))
        if inherited is not None:
            _probed[(world_size, backend)] = inherited
        else:
            _probed[(world_size, backend)] = _ask(world_size, {"what": "probe"}, "the schedules", timeout, backend)
            _share(world_size, backend)
    return _probed[(world_size, backend)]


# What an NCCL probe found, for this process's children (the gate's replay children and fuzz
# workers): the file of the process that probed first, named in the environment they inherit.
SHARED_ENV = "GRADFUZZ_PIPELINE_PROBES"


def _inherited(kind: str, key: tuple) -> Any:
    """A probe result that a parent process found on NCCL, or None.

    Each harness process used to probe for itself: on NCCL every one of the
    gate's sixteen fuzz workers started a one-rank and a two-rank group
    (a CUDA context and a communicator per rank, several seconds each while
    the others did the same) only to learn what its parent already knew, a
    fuzz worker that runs compile cases included. The result is a function
    of the installed torch and the machine, both the parent's, so it is
    taken as found. Only from another process: in the one that probed, the
    dicts above are the cache, as before. On gloo nothing is shared (a fork
    costs milliseconds), so CPU runs probe as they always did."""
    import os
    import pickle

    file = os.environ.get(SHARED_ENV)
    if not file:
        return None
    try:
        with open(file, "rb") as fh:
            shared = pickle.load(fh)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError):
        return None
    if shared.get("pid") == os.getpid() or shared.get("torch") != torch.__version__:
        return None
    return shared.get(kind, {}).get(key)


def _share(world_size: int, backend: str | None) -> None:
    """Write this process's probe results for its children, where its
    groups of this size run on NCCL (``_inherited``)."""
    import os
    import pickle
    import tempfile

    if (backend or pool_backend(world_size)) != "nccl":
        return
    file = os.environ.get(SHARED_ENV)
    mine = {"pid": os.getpid(), "torch": torch.__version__, "probe": dict(_probed), "same_rank": dict(_same_rank)}
    try:
        if not file or _owner(file) != os.getpid():
            fd, file = tempfile.mkstemp(prefix="gradfuzz-probes-", suffix=".pkl")
            os.close(fd)
            atexit.register(_remove, file)
        tmp = f"{file}.{os.getpid()}"
        with open(tmp, "wb") as fh:
            pickle.dump(mine, fh)
        os.replace(tmp, file)  # a child reading it sees the old or the new file, never half of one
    except OSError:
        return
    os.environ[SHARED_ENV] = file


def _remove(file: str) -> None:
    import os

    try:
        os.remove(file)
    except OSError:
        pass


def _owner(file: str) -> int | None:
    import pickle

    try:
        with open(file, "rb") as fh:
            return pickle.load(fh).get("pid")
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError):
        return None


_same_rank: dict[tuple, dict[str, Any]] = {}  # (world size, stage class[, backend given by --backend])


def same_rank_self_send(schedule: str, impl: str = STOCK, world_size: int = 1, timeout: float = 120.0,
                        backend: str | None = None) -> str | None:
    """The error if this torch's runtime for ``schedule``, with the stage
    class ``impl``, sends between two stages held by one rank through the
    process group, else None: found once per process, world size and stage
    class by ``pipeline_rank.same_rank_p2p``, on a group of one rank with the
    backend that world size's cases run on (on one GPU the one-rank pool is
    NCCL, which reaches itself, while two ranks share the CPU over gloo,
    which does not)."""
    key: tuple = (world_size, impl) if backend is None else (world_size, impl, backend)
    if key not in _same_rank:
        inherited = _inherited("same_rank", key)
        if inherited is not None:
            _same_rank[key] = inherited
        else:
            reply = _ask(world_size, {"what": "same_rank", "impl": impl}, "two stages on one rank", timeout, backend)
            _same_rank[key] = {"works": reply.get("works", []), "self_send": reply.get("self_send", {})}
            _share(world_size, backend)
    return _same_rank[key]["self_send"].get(schedule)


# What a schedule's run cannot show (the switches add retained grads and the RNG state).
BLIND = (
    NO_RECOMPUTATION, PLAIN_GRADS, NO_STEP_AFTER_SCHEDULE, NO_PARAM_HOOKS,
    (HOOK_FIRING, "the stages' backwards run inside torch's schedule runtime: the case's tensor hooks fire there, "
                  "uncounted per backward"),
)


class PipelinePath:
    def __init__(self, schedule: str, impl: str, world_size: int = 1, timeout: float = 10.0, name: str = "",
                 backend: str | None = None) -> None:
        flavour = "stock" if impl == STOCK else "fixed" if impl == FIXED else "custom"
        self.name = name or f"pipeline.{schedule}.{LAYOUTS.get(world_size, f'ranks{world_size}.')}{flavour}"
        self.schedule = schedule
        self.impl = impl
        self.world_size = world_size
        self.timeout = timeout
        self.backend = backend  # --backend; None: NCCL with a GPU per rank, else gloo
        # The gate's workaround reaches the ranks in the pool's request; the stages' parameters take
        # clone-grads there (rank.run_case), so the W pass's ``weight.grad = dw`` adopts a clone,
        # and the stages are built with example activations under stage-example-args.
        self.workarounds = ("clone-grads", "stage-example-args")

    @property
    def layouts(self) -> tuple[tuple[int, int], ...]:
        """The (stages, microbatches) pairs this path takes and fuzzing draws."""
        try:
            unrunnable = self._unrunnable()
            return tuple(x for x in self._layouts() if x not in unrunnable)
        except Exception:
            return ()

    @property
    def contract(self) -> Contract:  # type: ignore[override]
        layouts = self.layouts
        return Contract(retained_grads=False, draws=(layout_draw(layouts),) if layouts else (), model_parts=True,
                        random_ops=False, blind=BLIND)

    def _layouts(self) -> tuple[tuple[int, int], ...]:
        """The (stages, microbatches) the schedule's constructor takes here."""
        return tuple(sorted(tuple(x) for x in probe(self.world_size, backend=self.backend)["layouts"].get(self.schedule, ())))

    def _unrunnable(self) -> dict[tuple[int, int], str]:
        """Layouts the schedule takes that this torch cannot run here, with why:
        two adjacent stages on one rank, where the schedule's runtime with
        this stage class sends between them through gloo
        (``same_rank_self_send``: stock on torch 2.11; the fixed stage drops
        those sends)."""
        placement = probe(self.world_size, backend=self.backend)["placement"].get(self.schedule, {})
        out: dict[tuple[int, int], str] = {}
        for n, m in self._layouts():
            where = list(placement.get(n, ()))
            pair = next(((i, r) for i, (r, q) in enumerate(zip(where, where[1:])) if r == q), None)
            if pair is None:
                continue
            error = same_rank_self_send(self.schedule, self.impl, self.world_size, 120.0, self.backend)
            if error is None:
                return {}
            i, r = pair
            fix = "torch 2.13, whose runtime passes them directly"
            if self.world_size == 1:
                fix = f"pipeline.{self.schedule}.ranks2.* where it puts them on different ranks, or {fix}"
            out[(n, m)] = (f"{self.schedule} on {self.world_size} rank(s) puts stages {i} and {i + 1} on rank {r}: "
                           f"this torch's schedule runtime sends between two stages on one rank through gloo, which "
                           f"has no pair to itself (torch 2.11 _initialize_stages; probe: {error}); use {fix}")
        return out

    def availability(self) -> Availability:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_gloo_available():
            return Availability(False, "torch.distributed with the gloo backend is needed")
        if self.backend == "nccl" and (not dist.is_nccl_available() or torch.cuda.device_count() < self.world_size):
            return Availability(False, f"nccl needs {self.world_size} GPU(s) and a CUDA build of torch, found "
                                       f"{torch.cuda.device_count()} GPU(s)")
        if self.world_size > 1:
            # Stages on other ranks exchange their shapes with send_object_list,
            # which needs NumPy ("Numpy is not available" on the first step).
            try:
                import numpy  # noqa: F401
            except ImportError:
                return Availability(False, "stages on several ranks need NumPy (pip install 'gradfuzz[pipeline]')")
        try:
            info = probe(self.world_size, backend=self.backend)
        except Exception as e:
            return Availability(False, str(e)[:300])
        layouts = info["layouts"].get(self.schedule)
        if layouts is None:
            return Availability(False, f"torch {torch.__version__} has no schedule {self.schedule}")
        if not layouts:
            why = info.get("reasons", {}).get(self.schedule, "")
            return Availability(False, f"{self.schedule} takes no layout of at most 4 stages on "
                                       f"{self.world_size} rank(s){': ' + why if why else ''}")
        try:
            unrunnable = self._unrunnable()
        except Exception as e:
            return Availability(False, str(e)[:300])
        if all(tuple(x) in unrunnable for x in layouts):
            return Availability(False, next(iter(unrunnable.values())))
        layouts = [x for x in layouts if tuple(x) not in unrunnable]
        stages = sorted({s for s, _ in layouts})
        return Availability(True, f"{self.world_size} rank(s), {'/'.join(map(str, stages))} stages; "
                                  f"stage: {'PipelineStage as installed' if self.impl == STOCK else self.impl}")

    def supports(self, case: Case) -> str | None:
        from harness.materialize.stages import requires_grad

        s = case.schedule
        if reason := lifetime_schedule(case):
            return reason
        if reason := off_its_devices(case, "cuda" if (self.backend or pool_backend(self.world_size)) == "nccl" else "cpu"):
            return reason
        if s.clip or s.optimizer:
            return NO_STEP_AFTER_SCHEDULE[1]
        if any(len(x.shape) == 0 for x in case.inputs):
            return "an input without a batch dim cannot be split into microbatches"
        from harness.case.ops import draws_random

        if draws_random(case):
            return ("dropout: the schedule runs the microbatches' forwards in its own order on its own RNG stream, "
                    "so masks cannot match the case's (no RNG replay across stages in torch.distributed.pipelining)")
        layouts = self.layouts
        have = (len(stage_cuts(case)) + 1, s.microbatches)
        if have not in layouts:
            return self._unrunnable().get(have) or (f"{self.schedule} on {self.world_size} rank(s) takes (stages, "
                                                    f"microbatches) in {list(layouts)}, not {have}")
        need = requires_grad(case)
        if not any(need[u.ref] for u in case.outputs):
            return "no output requires grad (nothing for the schedule to train)"
        return None

    def run(self, case: Case) -> Observation:
        info = probe(self.world_size, backend=self.backend)
        where = info["placement"][self.schedule][len(stage_cuts(case)) + 1]
        group = _group(self.world_size, self.backend)
        wait = max(1.0, min(3.0, self.timeout / 3))
        if self.world_size > 1:
            _warm(group, wait)
        outcome = group.request(
            {"op": "call", "module": "harness.paths.pipeline.rank", "case": case.dumps(), "schedule": self.schedule,
             "impl": self.impl, "placement": list(where), "wait": wait}, self.timeout)
        if self.world_size > 1 and getattr(group, "backend", None) == "nccl" and \
                any(isinstance(r, dict) and (r.get("failure") or "error" in r) for r in outcome.replies.values()) \
                and not _freed(outcome, self.world_size):
            # A rank that raised mid-schedule leaves its peer's send or recv
            # unmatched. On gloo that op times out and the rank goes on (the
            # p2p group is replaced, ``pipeline_rank._group``); on NCCL its
            # kernel stays on the GPU, and the next case's new_group blocks
            # behind it: every case after a failing one hung (the NCCL
            # timeouts in docs/multi-gpu.md). Fresh ranks for the next case,
            # unless every rank aborted that group and its case thread ended
            # (``pipeline_rank.free_p2p``): then nothing is left on the GPUs.
            group.close()
        return observation(self.name, case, outcome)

    def repro(self, case: Case) -> Repro:
        stages = len(stage_cuts(case)) + 1
        try:
            placement = tuple(probe(self.world_size, backend=self.backend)["placement"][self.schedule][stages])
        except Exception:  # no pool here: the looped placement, which most schedules use
            placement = tuple(i % self.world_size for i in range(stages))
        return Repro(template="pipeline", family=Machinery(self.schedule, self.impl, placement, self.world_size))

    def close(self) -> None:
        from harness.workers import pool

        pool.close_group(self.world_size, self.backend)


def _freed(outcome: Any, world_size: int) -> bool:
    """Every rank answered and freed its p2p group after the failed case."""
    replies = outcome.replies
    return outcome.status == "ok" and len(replies) == world_size and all(
        isinstance(r, dict) and r.get("p2p_freed") for r in replies.values())


def _failures(obs: Observation, replies: dict[int, Any], M: int) -> list[tuple[bool, int, int, Failure]]:
    """Every rank's failure as (waited, backward, rank, failure), so that the
    first that raised sorts first and a peer's timeout is told from a cause."""
    failures = []
    for r in sorted(replies):
        rep = replies[r]
        if "error" in rep:
            failures.append((False, 10**9, r, Failure(-1, "WorkerError", rep["error"][:300])))
        elif rep.get("failure"):
            f = rep["failure"]
            k = f["step"] * M if f["step"] >= 0 else -1
            failures.append((bool(f.get("waited")), k if k >= 0 else 10**9, r, Failure(k, f["type"], f["message"])))
            obs.extra.setdefault("tracebacks", {})[r] = f.get("traceback", "")
    return failures


def _orphans(case: Case, replies: dict[int, Any]) -> Grads:
    """A parameter no stage uses belongs to no stage: its .grad is what it started as."""
    from harness.materialize.tensors import Built

    built = Built(case)
    init = case.schedule.grad_init
    held = {s_name for rep in replies.values() for st in rep["steps"][:1] for _, s_name, _ in st["grads"]}
    orphan: Grads = {}
    for p in case.params:
        if p.name not in held:
            orphan[p.name] = None if init == "none" or not p.requires_grad else \
                torch.zeros(p.shape, dtype=torch.float64) if init == "zero" else built.prefill()[p.name]
    return orphan


def _raced(obs: Observation, replies: dict[int, Any], M: int) -> bool:
    """A send buffer written while in flight (``inflight``) is the finding,
    and what the peer received after it is timing: the grads are then not
    compared, or the same case would diverge on one run and agree on the
    next, and the verdict would follow the machine's load."""
    written = [(r, step, what) for r in sorted(replies) for step, what in replies[r].get("inflight", [])]
    if not written:
        return False
    r, step, what = written[0]
    more = f" ({len(written) - 1} more)" if len(written) > 1 else ""
    obs.violations.append(Violation(
        "race", step * M + M - 1, "send buffer",
        f"rank {r}, step {step}: {what}{more}. torch.distributed.isend leaves a tensor written before its request "
        f"completes undefined: the peer gets the old or the new values depending on timing, so the grads after "
        f"it are not compared", key="send written in flight"))
    return True


def observation(name: str, case: Case, outcome: Any) -> Observation:
    """Rank facts -> one Observation: a Step per backward (parameter grads at
    the last backward of each step only), copies summed, failures merged."""
    obs = Observation(path=name)
    obs.extra["seconds"] = outcome.seconds
    replies = outcome.replies
    ranks = sorted(replies)
    M = case.schedule.microbatches
    failures = _failures(obs, replies, M)
    # A rank that raised is the finding; peers that then timed out waiting
    # for it are its consequence. Only waits with no cause are a hang.
    caused = [f for f in failures if not f[0]]
    if caused:
        obs.failure = min(caused, key=lambda t: (t[1], t[2]))[3]
    elif failures or outcome.status == "timeout":
        waits = "; ".join(f"rank {r}: {f.message}" for _, _, r, f in failures)
        obs.violations.append(Violation("timeout", -1, "process group",
                                        f"the schedule hung (ranks waiting on each other, none raised first): "
                                        f"{waits or outcome.detail}", key="timeout"))
        return obs
    if outcome.status == "timeout":
        return obs
    if outcome.status == "crash":
        obs.violations.append(Violation("crash", -1, "process group",
                                        f"a rank died running the schedule: {outcome.detail}", key="crash"))
        return obs
    if not ranks or any("steps" not in replies[r] for r in ranks):
        if obs.failure is None:
            obs.failure = Failure(-1, "WorkerError", "not every rank replied")
        return obs
    if _raced(obs, replies, M):
        return obs
    for r in ranks:
        for m in replies[r].get("mutations", []):
            obs.mutations.append(Mutation(m.k * M + M - 1, m.what, m.max_abs))
    orphan = _orphans(case, replies)
    n_steps = min(len(replies[r]["steps"]) for r in ranks)
    for s in range(n_steps):
        recs = [replies[r]["steps"][s] for r in ranks]
        grads: Grads = {p.name: None for p in case.params}
        for rec in recs:
            for _, n, g in rec["grads"]:
                if g is not None:
                    grads[n] = g if grads[n] is None else grads[n] + g
        grads.update(orphan)
        inputs = next((rec["input_grads"] for rec in recs if "input_grads" in rec), {})
        outputs = next((rec["outputs"] for rec in recs if "outputs" in rec), {})
        for j in range(M):
            k = s * M + j
            in_grads: Grads = {x.name: None if inputs.get(x.name) is None else inputs[x.name][j] for x in case.inputs}
            outs = outputs.get(k) or []
            obs.steps.append(Step(k=k, grads=dict(grads) if j == M - 1 else None,  # type: ignore[arg-type]
                                  input_grads=in_grads, outputs=list(outs)))
    return obs


def paths(options: Options) -> list[PipelinePath]:
    """The registry's hook: stock and fixed for every schedule torch exports,
    in one process and on two ranks. Under torchrun the DTensor paths own the
    group; the pipeline paths are not offered there."""
    from harness.paths.pipeline.rank import schedule_names
    from harness.workers import pool

    if pool.torchrun_env():
        return []
    timeout = options.timeout
    made = []
    for ws in LAYOUTS:
        for schedule in schedule_names():
            made += [PipelinePath(schedule, STOCK, ws, timeout, backend=options.backend),
                     PipelinePath(schedule, FIXED, ws, timeout, backend=options.backend)]
    return made
