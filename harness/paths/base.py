"""The path protocol and the schedule loop most paths share.

A path is anything with a name, an availability (with the reason when it is
not available here), a contract (which cases it may be given) and
``run(case) -> Observation``. Paths that train by microbatches reuse
``run_schedule`` and only supply their backward (and, if they wrap the
module, their forward); the loop does the snapshots and stability checks,
so every path is held to the same rules.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable


from harness.generate import Draw
from harness.materialize.schedule import Observe
from harness.case.spec import Case
from harness.observation import (HOOK_FIRING, HOOK_KEPT, LAYOUT, LIFETIME, MUTATION, OPTIMIZER_STATE, PLACEMENT,
                                  RECOMPUTATION, RETAINED, RNG_STATE, Observation)

# Blind spots several families share, each reason written once. A family
# composes its ``Contract.blind`` from these and its own.
NO_RECOMPUTATION = (RECOMPUTATION, "the machinery runs no user forward a second time: there is no count to compare")
PLAIN_GRADS = (PLACEMENT, "one process and plain tensors: a grad has no placements and accumulating it issues no "
                          "collective")
RNG_NOT_COMPARED = (RNG_STATE, "not compared yet: this family's loop does not record the RNG state after its call "
                              "(the eager, split and checkpoint paths do)")
# Parameter hooks are drawn only with lifetime schedules (``engine_rules.lifetime_schedule``).
NO_PARAM_HOOKS = (HOOK_KEPT, "parameter hooks come with lifetime schedules, drawn for the graphed paths only "
                             "(lifetime_schedule refuses them here)")
# The third-party stacks' grads are read whole through their own accessors.
FULL_VALUES = (PLACEMENT, "grads are read whole through the stack's own accessor (safe_get_full_grad, main_grad, "
                          "full_tensor()): placements and collectives are not compared")
# Pipeline schedules (pipeline.*, mesh.pp_dp.*) refuse a clip or optimizer step after step().
NO_STEP_AFTER_SCHEDULE = (OPTIMIZER_STATE, "a training step after the schedule (clip, optimizer) is not part of this "
                                           "path")
# The rank loops (dtensor, ddp, fsdp2) build their own microbatch loop, not run_schedule's.
RANK_LOOP = (
    (HOOK_KEPT, "the rank loop registers no parameter hooks (lifetime schedules are not drawn for rank families)"),
    (HOOK_FIRING, "the rank loop does not count the case's tensor hooks per backward"),
    (MUTATION, "the rank loop holds no user tensors between backwards (run_schedule's Held is single-process)"),
    (LIFETIME, "the rank loop watches no saved tensors: a rank's graph lifetime is not checked"),
)
# What a third-party stack's rank loop cannot show, besides its own reasons.
STACK_LOOP = (*RANK_LOOP, NO_RECOMPUTATION, RNG_NOT_COMPARED, FULL_VALUES)
# A contract switch that is off already says an observation cannot be made:
# (switch, observation, why). A family's own reason for it, in
# ``Contract.blind``, is kept in place of this one.
IMPLIED = (
    ("retained_grads", RETAINED, "the contract does not promise retained grads (retained_grads=False)"),
    ("grad_layout", LAYOUT, "the contract does not promise .grad strides (grad_layout=False)"),
    ("graph_freed", LIFETIME, "the contract does not promise the graph freed after backward (graph_freed=False)"),
    ("random_ops", RNG_STATE, "random ops are not drawn for this path (random_ops=False): no RNG state to compare"),
    ("tensor_hooks", HOOK_FIRING, "the case's tensor hooks are not drawn for this path (tensor_hooks=False)"),
    ("tensor_hooks", RETAINED, "retain_grad is not drawn for this path (tensor_hooks=False)"),
)


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""
    # Not available because the installed release of the stack lacks what the
    # path drives (DeepSpeed's loss.backward() before 0.18.3): the bug cannot
    # be there, so ``gradfuzz versions`` counts that release as not affected
    # rather than as one without an answer.
    absent: bool = False


@dataclass(frozen=True)
class Contract:
    """What a path promises, as data.

    ``retained_grads``: intermediate ``.grad`` from ``retain_grad`` is part
    of the promise. A split backward legitimately runs the shared part of
    the graph twice, so split paths do not promise it.
    """

    retained_grads: bool = True
    # Draw buffer-lifetime schedules (allocator pressure, held outputs,
    # parameter hooks) when fuzzing this path: paths that keep buffers
    # across backwards (graph wrappers) want them.
    lifetime_schedules: bool = False
    # The family's own draws (``harness.generate.Draw``: stage cuts, regions,
    # wrapper switches, parameter placements), drawn after the core case in
    # this order. Empty: the core case only.
    draws: tuple[Draw, ...] = ()
    # Draw the cases real training has and the founding generator never
    # built (``harness.generate.gap_cases``): frozen and unused parameters,
    # inputs and outputs that need no grad in any position, microbatch size
    # 1, a last stage handing a scalar loss.
    gap_cases: bool = False
    # Draw the model parts (``generate.MODEL_BLOCKS``: tied embedding and
    # head, norms, attention, gated MLPs, index ops, cross-entropy losses).
    model_parts: bool = False
    # What ``run_schedule`` observes beyond values (``Observe``): a leaf
    # input's ``.grad`` (a path whose machinery hands input grads back
    # instead, as a pipeline stage does, says False), ``.grad`` strides
    # against the parameter's, and the graph freed after each backward.
    leaf_input_grads: bool = True
    # The machinery needs a (stage) input that requires grad (stock split).
    # Not a strategy flag, so it does not split a group of paths: a target
    # draws x0 with requires_grad only when every path of it says so.
    input_grad: bool = False
    # Random ops (dropout) can be checked: the path reproduces the case's
    # seeded mask. Like ``input_grad``, it steers a target's draws only when
    # every path of it says False.
    random_ops: bool = True
    # The case's tensor hooks and retain_grad can be drawn. False (a machinery
    # that traces the forward with fullgraph=True refuses both) gives the
    # path a target of its own whose cases have neither: torchtitan's
    # compiled blocks refused most of a shared target's draws.
    tensor_hooks: bool = True
    grad_layout: bool = True
    graph_freed: bool = False
    graph_freed_while_held: bool = True
    # The path whose machinery this one is built on and whose bugs it has by
    # construction (checkpoint paths accumulate through eager's AccumulateGrad):
    # where that path diverges from the oracle too, a divergence is not held
    # against this one. The engine runs it, with the case's own tolerance.
    judged_against: str = ""
    # The observations (``harness.observation.OBSERVATIONS``) this path's
    # machinery cannot show, each with the reason (the documentation that
    # says so): ``(name, why)`` pairs. Every other observation the path must
    # make; compare does not hold it to these.
    blind: tuple[tuple[str, str], ...] = ()
    # Cases checked per drawn structure: the drawn case and ``data_variants - 1``
    # cases of the same graph with other data (seed, grad state before the first
    # backward, zero_grad mode). A machinery that compiles per structure
    # (torch.compile: seconds to compile, milliseconds to run) checks many data
    # for one compile; its reuse of a compiled artifact across them (guards,
    # cached grads state) is then exercised too.
    data_variants: int = 1

    def blind_spots(self) -> tuple[tuple[str, str], ...]:
        """The declared blind spots and those the switches imply, each once."""
        out = list(self.blind)
        for switch, name, why in IMPLIED:
            if not getattr(self, switch) and all(name != have for have, _ in out):
                out.append((name, why))
        return tuple(out)

    def blind_to(self) -> frozenset[str]:
        """The names of the observations this path cannot make."""
        return frozenset(name for name, _ in self.blind_spots())

    def strategy_flags(self) -> tuple[tuple[str, object], ...]:
        """The generator keywords this contract asks for; paths with equal
        flags draw from one case distribution and are fuzzed together."""
        flags: tuple[tuple[str, object], ...] = (("lifetime", self.lifetime_schedules),)
        flags += (("gaps", True),) if self.gap_cases else ()
        flags += (("model", True),) if self.model_parts else ()
        flags += (("hooks", False),) if not self.tensor_hooks else ()
        flags += (("variants", self.data_variants),) if self.data_variants > 1 else ()
        return flags + ((("draws", self.draws),) if self.draws else ())

    def observe(self) -> "Observe":
        """The RNG state is recorded where random ops are drawn and the contract is not blind to it."""
        return Observe(self.leaf_input_grads, self.grad_layout, self.graph_freed, self.graph_freed_while_held,
                       rng_state=self.random_ops and RNG_STATE not in self.blind_to())


class UsageError(ValueError):
    """Bad path names or path options: the CLI exits 2 with this message."""


@dataclass(frozen=True)
class Options:
    """Everything a path factory may read; the CLI fills it from its flags."""

    # The user's own code behind a family's path: (``UserImpl.option``,
    # MODULE[:ATTR]) pairs, from the families' flags (``--split-impl``, ...).
    impls: tuple[tuple[str, str], ...] = ()
    backend: str | None = None  # --backend gloo|nccl for process groups (default: nccl when there is a GPU per rank)
    world_size: int = 2  # --world-size, for process-group paths
    timeout: float = 10.0  # --timeout seconds, per case on multi-process paths
    extra: tuple[str, ...] = ()  # --path MODULE:ATTR

    def impl(self, option: str) -> str | None:
        """The user's code named for a family's ``option`` (``split_impl``), or None: torch's own."""
        return dict(self.impls).get(option)

    def flat(self) -> dict[str, object]:
        """The options that differ from the defaults, one ``name: value`` each (impls by their option)."""
        default = Options()
        out: dict[str, object] = dict(self.impls)
        for f in fields(self):
            if f.name not in ("impls", "extra") and getattr(self, f.name) != getattr(default, f.name):
                out[f.name] = getattr(self, f.name)
        return out


@dataclass(frozen=True)
class Repro:
    """What a standalone repro script needs of a path's machinery, as data.

    ``template`` picks the script's shape (``harness.artifacts.repro.script``):

    - ``schedule``: the microbatch loop, with ``imports`` and ``backward`` (the
      body of ``backward(outs, cots, inputs, params)``), and ``forward``:
      source defining ``DEVICE`` and ``machinery_forward(v)`` for paths that
      wrap the module too ("" = the plain forward on the CPU);
    - ``none``: no standalone script; ``why`` says so and the script replays
      the corpus file with gradfuzz instead;
    - any other: a family's own script (``Family.scripts``: pipeline stages,
      ranks under torchrun), whose writer reads ``family``, the family's
      own description of its machinery (schedule, ranks, implementation).
    """

    template: str = "schedule"
    imports: str = ""
    backward: str = ""
    forward: str = ""
    family: Any = None
    why: str = ""


@runtime_checkable
class Path(Protocol):
    name: str
    contract: Contract

    def availability(self) -> Availability: ...

    def supports(self, case: Case) -> str | None:
        """None if the case is inside the contract, else why not."""
        ...

    def run(self, case: Case) -> Observation: ...

    def repro(self, case: Case) -> Repro:
        """The machinery of this path as a standalone script needs it."""
        ...


def in_child(path: Path) -> bool:
    """The path runs its cases in a child process of its own (``worker``,
    ``recipe``: compile flavours, graphed paths), where each new structure
    costs a compile or a capture: seconds, against milliseconds for the oracle."""
    return hasattr(path, "worker") or hasattr(path, "recipe")


def heaviness(path: Path) -> int:
    """A rough cost class of a case on ``path``, for handing work out heaviest
    first (gate replay groups, fuzz targets) so that the slowest group does
    not start last while the other processes sit idle. A path run in a child
    (``worker``, ``recipe``: compile, graphed) compiles or captures there,
    about a second per new structure, and ranks first (the heavier its
    ``cost``, a small int the path may declare, the earlier); then the
    paths with ranks, by their number; in-process paths are 0."""
    if in_child(path):
        return 100 + int(getattr(path, "cost", 0))
    ranks = getattr(path, "world_size", 0)
    return ranks if isinstance(ranks, int) and ranks > 0 else 0


# Drawn examples a shard of a target whose paths run in children gets at least.
# Each such shard starts one child per path, and each compiles cold; on torch 2.11
# each Inductor child also probes the vector ISAs, a fresh ``import torch`` per
# probe under a lock every process of the cache directory shares: at -n 16 (16
# shards, 48 Inductor children) the compile target waited minutes for it.
CHILD_SHARD_EXAMPLES = 4


def shards_for(paths: list[Path], shards: int, examples: int | None) -> int:
    """Shards for one fuzz target: ``shards``, fewer where its paths run in
    children and the budget would leave each shard less than
    ``CHILD_SHARD_EXAMPLES`` (a time budget keeps them all)."""
    if examples is None or not any(in_child(p) for p in paths):
        return shards
    return max(1, min(shards, examples // CHILD_SHARD_EXAMPLES))


def format_exception(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()
