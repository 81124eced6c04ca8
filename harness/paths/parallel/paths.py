"""``ddp.*`` and ``fsdp2.*``: the case's module under DistributedDataParallel
or ``fully_shard`` on a real process group.

Every rank runs the same microbatches with its own share of each grad
output (``harness.paths.parallel.rank``), so the grads the wrapper averages
over ranks must equal the oracle's after every backward that ends an
accumulation window, on every rank. Besides values this path holds the
wrappers to what they promise about communication and layout:

- *replicas*: after a synchronising backward DDP's ``.grad`` (and after a
  step, every parameter) is the same on every rank; FSDP2's ``.grad`` is a
  ``Shard(0)`` DTensor whose local piece has its parameter's local shape;
- *reductions*: a ``no_sync`` backward reduces nothing, and where the
  wrapper lets them be counted (a Python comm hook on DDP, the fixed
  references) each parameter with a grad is reduced exactly once per
  synchronising backward, a tied one too, whatever buckets it spans;
- *layout*: ``.grad`` strides as the parameter's (bucket views included).

``ddp.stock`` / ``fsdp2.stock`` are torch as installed; ``ddp.fixed`` /
``fsdp2.fixed`` install ``oracles.ddp_fixed`` / ``oracles.fsdp2_fixed``.
The process group is the worker pool's (``harness.workers.pool``), shared
with the DTensor paths; ``--world-size`` sets it (1, 2, 3 on gloo).
"""

from __future__ import annotations

from typing import Any


from harness.case.spec import Case
from harness.observation import Observation, Violation
from harness.paths.engine_rules import lifetime_schedule, off_its_devices
from harness.paths.base import NO_RECOMPUTATION, RANK_LOOP, RNG_NOT_COMPARED, Availability, Contract, Options, Repro
from harness.paths.parallel.data import LOW_PRECISION, Machinery, switches
from harness.paths.parallel.data import SWITCHES
from harness.paths.pooled import PooledPath
from harness.paths.rankfacts import rounded_by_reduction
from harness.paths.workarounds import IN_PROCESS
from harness.paths.assemble import observation as assemble

STOCK = "stock"
# The switches a standalone script (harness.paths.parallel.script) spells out.
SCRIPTED = frozenset({"no_sync", "bucket_view", "static_graph", "find_unused", "small_buckets", "hook_allreduce",
                      "hook_builtin", "keep_unsharded", "reshard_int", "no_reshard_after_backward"})
FIXED = {"ddp": "oracles.ddp_fixed", "fsdp2": "oracles.fsdp2_fixed"}


def _unreached(case: Case) -> list[str]:
    """Trainable parameters no output that requires grad depends on."""
    from harness.materialize.stages import requires_grad

    need = requires_grad(case)
    live = {u.ref for u in case.outputs if need.get(u.ref)}
    for node in reversed(case.nodes):
        if node.name in live:
            live.update(u.ref for u in node.args)
    return [p.name for p in case.params if p.requires_grad and p.name not in live]


class DataParallelPath(PooledPath):
    contract = Contract(retained_grads=True, draws=(SWITCHES,), gap_cases=True, model_parts=True,
                        blind=(*RANK_LOOP, NO_RECOMPUTATION, RNG_NOT_COMPARED))

    def __init__(self, name: str, kind: str, impl: str, world_size: int = 2, timeout: float = 10.0,
                 backend: str | None = None) -> None:
        super().__init__(name, world_size, timeout, backend)
        self.kind = kind
        self.impl = impl
        # The pool's request carries the gate's workaround to the ranks: DDP's
        # parameters take clone-grads (on_params); FSDP2 reduces into its own
        # sharded grads, so only its trainer's optimizer-for-loop reaches it.
        self.workarounds = IN_PROCESS if kind == "ddp" else ("optimizer-for-loop",)

    def availability(self) -> Availability:
        where = self.group_availability()
        if not where.ok:
            return where
        if self.kind == "fsdp2":
            try:
                from torch.distributed.fsdp import fully_shard  # noqa: F401
            except ImportError as e:
                return Availability(False, f"this torch has no torch.distributed.fsdp.fully_shard ({e})")
        return Availability(True, f"{where.reason}; {self.kind}: {'torch as installed' if self.impl == STOCK else self.impl}")

    def supports(self, case: Case) -> str | None:
        s = case.schedule
        if reason := lifetime_schedule(case):
            return reason
        world = self._world()
        if case.exact and world & (world - 1):
            return (f"exact mode needs a power-of-two world size: the wrappers divide by {world}, which rounds "
                    f"(tolerance-mode cases run at any world size)")
        if self.kind == "ddp" and not any(p.requires_grad for p in case.params):
            return "every parameter is frozen: DDP refuses a module with nothing to reduce (documented ValueError)"
        if self.kind == "ddp" and self.impl == STOCK and "find_unused" not in switches(case).options:
            unused = _unreached(case)
            if unused:
                return (f"parameter(s) {', '.join(unused)} get no grad: DDP requires find_unused_parameters=True "
                        f"then (documented; it raises at the next forward otherwise)")
        if self.kind == "ddp" and self.impl == STOCK and "bf16_reduce" in switches(case).options \
                and self.backend_name() != "nccl":
            return ("bf16_reduce: DDP's bf16_compress_hook needs NCCL (it raises 'BF16 all reduce communication "
                    "hook required CUDA 11+ and NCCL 2.10+' on gloo)")
        if reason := off_its_devices(case, "cuda" if self.backend_name() == "nccl" else "cpu"):
            return reason
        if self.kind == "fsdp2" and s.optimizer and s.optimizer_impl == "fused":
            return "fused optimizers have no DTensor sharding strategy on every torch (FSDP2 parameters are DTensors)"
        if self.kind == "fsdp2" and s.optimizer == "rprop":
            return ("rprop on Shard(0) DTensor parameters: its foreach form needs _foreach_copy_, its loop form an "
                    "in-place index_put_, neither with a sharding strategy that keeps Shard(0) (raises on every path)")
        return None

    def run(self, case: Case) -> Observation:
        outcome = self.group.request({"op": "call", "module": "harness.paths.parallel.rank", "case": case.dumps(),
                                      "kind": self.kind, "impl": self.impl}, self.timeout)
        obs = assemble(self.name, case, outcome)
        obs.precision, obs.rounded = self.rounding(case)
        if outcome.status == "ok":
            _judge_reductions(obs, self.kind, outcome.replies)
            _judge_shards(obs, self.kind, outcome.replies)
        return obs

    def rounding(self, case: Case) -> tuple[str | None, dict | None]:
        """The lower type the wrapper reduces grads in, and what it rounds
        there (``Observation.rounded``); the fixed references reduce in the
        case's dtype, whatever the switch."""
        low = next((LOW_PRECISION[o] for o in switches(case).options if o in LOW_PRECISION), None)
        if self.impl != STOCK or low is None:
            return None, None
        return low, rounded_by_reduction(case, self._world())

    def repro(self, case: Case) -> Repro:
        if self.impl == STOCK and set(switches(case).options) <= SCRIPTED and not case.schedule.optimizer:
            return Repro(template="dataparallel", family=Machinery(self.kind, self._world()))
        return Repro(template="none", why=f"{self.name}: the script spells neither units, checkpointed blocks, "
                     f"optimizer steps nor a wrapper other than torch's: replay the corpus file with "
                     f"`gradfuzz repro FILE --paths {self.name}` (it starts the ranks itself)")



def _judge_reductions(obs: Observation, kind: str, replies: dict[int, Any]) -> None:
    """Reductions per backward on rank 0 (every rank runs the same schedule)."""
    from harness.paths.parallel.rank import _reducing

    steps = replies.get(0, {}).get("steps", [])
    seen: set[str] = set()
    pending: set[str] = set()  # parameters that got a grad since the last synchronising backward
    for st in steps:
        k = st["k"]
        pending.update(st.get("arrived") or ())
        obs.extra.setdefault("collectives", []).append(st["collectives"])
        if not st["sync"]:
            n = _reducing(st["collectives"])
            if n and "no_sync" not in seen:
                seen.add("no_sync")
                obs.violations.append(Violation(
                    "collective", k, "no_sync",
                    f"backward {k} ran inside no_sync / set_requires_gradient_sync(False) and issued {n} reducing "
                    f"collective(s) ({st['collectives']}); an accumulation window reduces only at its last backward",
                    key="reduction inside no_sync"))
        reduced = st.get("reduced")
        if reduced is None:
            continue
        for name, times in reduced.items():
            want_max = 1 if st["sync"] else 0
            missing = st["sync"] and times == 0 and name in pending and name in st["with_grad"]
            if (times > want_max or missing) and name not in seen:
                seen.add(name)
                where = "a synchronising backward" if st["sync"] else "a no_sync backward"
                obs.violations.append(Violation(
                    "collective", k, name,
                    f"{name}'s grad was reduced {times} time(s) in backward {k}, {where}; expected "
                    f"{want_max}: {kind} reduces each parameter with a grad once per accumulation window "
                    f"(a tied parameter too, whatever buckets it spans)",
                    key=f"reduced {min(times, 3)} times, sync={st['sync']}"))
        if st["sync"]:
            pending.clear()


def _judge_shards(obs: Observation, kind: str, replies: dict[int, Any]) -> None:
    """FSDP2 grads: ``Shard(0)`` DTensors with their parameter's local shape."""
    if kind != "fsdp2":
        return
    seen: set[str] = set()
    for r in sorted(replies):
        for st in replies[r].get("steps", []):
            for name, enc in st["grads"].items():
                if enc is None or name in seen:
                    continue
                if enc["pl"] != "S0":
                    seen.add(name)
                    obs.violations.append(Violation(
                        "placement", st["k"], name, f"{name}.grad on rank {r} after backward {st['k']} is placed "
                        f"{enc['pl']}; FSDP2 keeps a parameter's grad Shard(0), as the parameter",
                        key=f"fsdp2 grad placed {enc['pl']}"))
                elif tuple(enc["local"].shape) != tuple(st["local_shapes"][name]):
                    seen.add(name)
                    obs.violations.append(Violation(
                        "placement", st["k"], name, f"{name}.grad on rank {r} after backward {st['k']} holds a local "
                        f"piece of shape {tuple(enc['local'].shape)}, its parameter's is {tuple(st['local_shapes'][name])}: "
                        f"an uneven last shard padded or cut wrongly", key="fsdp2 grad local shape"))


def paths(options: Options) -> list[DataParallelPath]:
    """The registry's hook: ddp and fsdp2, stock and fixed, on the worker pool."""
    ws, timeout, backend = options.world_size, options.timeout, options.backend
    return [DataParallelPath(f"{kind}.{which}", kind, STOCK if which == "stock" else FIXED[kind], ws, timeout, backend)
            for kind in ("ddp", "fsdp2") for which in ("stock", "fixed")]
