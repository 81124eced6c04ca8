"""``dtensor.*``: parameters as DTensors on a real process group.

Values can be right while the distributed semantics are wrong (the seed:
a Partial grad silently turned Replicate by an all-reduce nobody asked
for), so besides every grad's full value after every backward this path
checks two invariants of ``AccumulateGrad`` on DTensor parameters:

- *placement*: ``.grad`` keeps the placements the grad arrived with when
  ``.grad`` was None, and keeps its own when the grad is added into it (an
  in-place sum cannot change the placement of the tensor summed into). A
  Replicate parameter fed Partial grads ends with Partial grads until the
  user reduces them.
- *collectives*: between the grad's arrival (a hook on the parameter) and
  ``.grad`` being updated (its post-accumulate hook), the only collective
  allowed is the one the in-place sum itself needs to bring the arriving
  grad to ``.grad``'s placements: none when they match or when ``.grad``
  was None. With every parameter used through ``to_local`` (the seed's
  pattern) the whole backward must issue none.

Ranks report local shards; values are assembled here from them, which also
checks that Replicate values agree on every rank. Parameters are placed as
the case says (``Param.placement``: the seed's to_local/Partial pattern,
Replicate, Shard(d), or ColwiseParallel/RowwiseParallel through
``parallelize_module``), and a schedule may end each step with
``clip_grad_norm_`` and an optimizer step, after which parameters, clipped
grads and the grads the optimizer left behind are compared too.

``dtensor.stock`` is torch as installed (or ``--dtensor-impl``);
``dtensor.fixed`` installs ``oracles.dtensor_fixed``: a grad-layout fix that
keeps the placement and issues no collective, and grads of their own for
the optimizer. The process group is a ``harness.workers.pool.WorkerPool`` (or the
launcher's, under torchrun), shared by both paths.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.observation import Observation
from harness.generate import PLACEMENTS
from harness.paths import dtensor_rules
from harness.paths.base import NO_RECOMPUTATION, RANK_LOOP, RNG_NOT_COMPARED, Availability, Contract, Options, Repro
from harness.paths.assemble import observation
from harness.paths.engine_rules import lifetime_schedule, off_its_devices
from harness.paths.dtensor.data import Machinery
from harness.paths.pooled import PooledPath
from harness.paths.workarounds import IN_PROCESS
from harness.case.spec import Case
from harness.generate import tp_eligible

FIXED = "oracles.dtensor_fixed"
# Optimizers whose fused kernel has no DTensor sharding strategy (torch 2.13: only Adam/AdamW have one).
DTENSOR_UNFUSED = frozenset({"sgd", "momentum", "nesterov", "adagrad"})
STOCK = "stock"


# torch 2.11's DTensor raises on an in-place op whose output placement differs
# from its input's (relu_ on a Partial value); found on dtensor.fixed with NCCL
# and reproduced with gloo on 2.11; 2.13 agrees on the same cases.


def _has_strategy(op: Any) -> bool:
    """Can this torch's DTensor propagate shardings for ``op`` at all? Its op
    coverage grows from version to version; asking it beats a version table."""
    try:
        from torch.distributed.tensor import DTensor

        prop = DTensor._op_dispatcher.sharding_propagator
    except Exception:
        return True
    tables = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")
    return any(op in getattr(prop, t, {}) for t in tables)


class DTensorPath(PooledPath):
    contract = Contract(retained_grads=True, draws=(PLACEMENTS,), model_parts=True,
                        blind=(*RANK_LOOP, NO_RECOMPUTATION, RNG_NOT_COMPARED))
    # The pool's request carries the gate's workaround to the ranks' parameters
    # and trainer (clone-grads copies a DTensor grad shard by shard, placements
    # kept: no collective of the harness's making).
    workarounds = IN_PROCESS

    def __init__(self, name: str, impl: str, world_size: int = 2, timeout: float = 10.0,
                 backend: str | None = None) -> None:
        super().__init__(name, world_size, timeout, backend)
        self.impl = impl

    def availability(self) -> Availability:
        where = self.group_availability()
        if not where.ok:
            return where
        if self.impl != STOCK:
            try:
                _check_impl(self.impl)
            except Exception as e:
                return Availability(False, f"grad-layout implementation {self.impl!r}: {e}")
        return Availability(True, f"{where.reason}; grad layout: {'torch as installed' if self.impl == STOCK else self.impl}")

    def supports(self, case: Case) -> str | None:
        from harness.paths.dtensor.rank import mode_of

        s = case.schedule
        if reason := lifetime_schedule(case):
            return reason
        if reason := off_its_devices(case, "cuda" if self.backend_name() == "nccl" else "cpu"):
            return reason
        if s.optimizer in DTENSOR_UNFUSED and s.optimizer_impl == "fused":
            return f"DTensor has no sharding strategy for fused {s.optimizer} (NotImplementedError on every path)"
        if s.optimizer == "rprop" and (s.optimizer_impl != "for_loop" or mode_of(case) == "dtensor"):
            return ("rprop on DTensor: its foreach form needs _foreach_copy_ (no sharding strategy), its loop form "
                    "an index_put_ DTensor refuses on sharded parameters; run only as a for-loop on Replicate parameters")
        if s.optimizer == "rprop" and not _has_strategy(torch.ops.aten.index_put_.default):
            return ("rprop's loop form needs index_put_, for which this torch's DTensor has no sharding strategy "
                    "(NotImplementedError on every path; 2.13 has one)")
        return self._placed_refusal(case) if mode_of(case) == "dtensor" else None

    def _placed_refusal(self, case: Case) -> str | None:
        """Why a case whose parameters are placed DTensors (its forward runs
        on DTensors) is outside the contract; None: inside."""
        s = case.schedule
        if why := dtensor_rules.refusal(case):
            return why
        world = self._world()
        if case.exact and world & (world - 1) and any(n.op == "opinfo" and n.attr("place") == -3 for n in case.nodes):
            return (f"an OpInfo input as Partial(avg) on {world} ranks: its pieces are {world} times the value, "
                    f"which rounds, and exact mode allows no rounding (tolerance-mode cases take it)")
        if any((p.placement or "partial") == "partial" for p in case.params):
            return "mixes to_local/Partial parameters with DTensor-placed ones"
        if any(p.placement in ("colwise", "rowwise") and not tp_eligible(case, p.name) for p in case.params):
            return "a tensor-parallel style needs a weight used only as the right operand of a matmul (h @ w)"
        sharded = [p.name for p in case.params if p.placement.startswith("shard") or p.placement in ("colwise", "rowwise")]
        thin = [p.name for p in case.params if p.placement.startswith("shard")
                and p.shape[int(p.placement[5:])] < self._world()]
        writes = (s.grad_init != "none" or s.microbatches > 1 or s.optimizer or s.clip
                  or (s.steps > 1 and s.zero_grad != "set_to_none"))
        expanded = {u.ref for n in case.nodes if n.op == "expand" for u in n.args}
        broadcast = {p.name for p in case.params if p.placement.startswith("shard") and p.shape[int(p.placement[5:])] == 1}
        if (set(thin) | broadcast) & expanded:  # a size-1 dim raises it on a one-rank mesh too
            return ("expand of a parameter sharded on a dim with fewer elements than ranks: DTensor's sharding "
                    "propagation raises a bare KeyError (torch bug, seen on 2.13: _rewrite_plain_shard)")
        if thin and writes:
            return ("a parameter is sharded on a dim with fewer elements than ranks: DTensor has no in-place "
                    "strategy for it, so accumulating into its .grad raises (torch bug, see cases/dtensor/)")
        if why := dtensor_rules.uneven_view(case, sharded):
            return why
        if _unused_function_output(case):
            return ("an autograd.Function output is unused: torch materializes its grad as a plain "
                    "tensor, not a DTensor, and the Function's backward raises (torch bug, see cases/dtensor/)")
        return None

    def run(self, case: Case) -> Observation:
        outcome = self.group.request({"op": "call", "module": "harness.paths.dtensor.rank", "case": case.dumps(), "impl": self.impl},
                                     self.timeout)
        return observation(self.name, case, outcome)

    def repro(self, case: Case) -> Repro:
        s = case.schedule
        if s.grad_init == "none" and not s.clip and not s.optimizer:
            return Repro(template="torchrun", family=Machinery(self.impl, self.world_size))
        return Repro(template="none", why=f"{self.name}: the torchrun script starts .grad as None and takes no "
                     f"clip or optimizer step: replay the corpus file with `gradfuzz repro FILE --paths {self.name}` "
                     f"(it starts the ranks itself)")



def _unused_function_output(case: Case) -> bool:
    """Does a live multi-output custom Function (``pair``) have a result no live node uses?"""
    live: set[str] = {u.ref for u in case.outputs}
    used: set[tuple[str, int | None]] = {(u.ref, u.index) for u in case.outputs}
    for node in reversed(case.nodes):
        if node.name in live:
            for u in node.args:
                live.add(u.ref)
                used.add((u.ref, u.index))
    return any(n.op == "pair" and n.name in live and not {(n.name, 0), (n.name, 1)} <= used for n in case.nodes)


def _check_impl(spec: str) -> None:
    from harness.paths.dtensor.rank import load_impl

    load_impl(spec)


def paths(options: Options) -> list[DTensorPath]:
    """The registry's hook. Under torchrun this is rank 0 (the CLI sends the
    other ranks to ``pool.follow_torchrun`` before any path is made)."""
    from harness.workers import pool

    ws, timeout, backend = options.world_size, options.timeout, options.backend
    stock = options.impl("dtensor_impl") or STOCK
    made = [DTensorPath("dtensor.stock", stock, ws, timeout, backend), DTensorPath("dtensor.fixed", FIXED, ws, timeout, backend)]
    if pool.torchrun_env():
        made[0].group  # join now: every rank joins at start-up, whatever is fuzzed
    return made
