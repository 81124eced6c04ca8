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

from harness.observation import Failure, Grads, Observation, Step, Violation
from harness.generate import PLACEMENTS
from harness.paths.base import Availability, Contract, Options, Repro
from harness.paths.pooled import PooledPath
from harness.case.spec import Case
from harness.generate import tp_eligible

FIXED = "oracles.dtensor_fixed"
# Optimizers whose fused kernel has no DTensor sharding strategy (torch 2.13: only Adam/AdamW have one).
DTENSOR_UNFUSED = frozenset({"sgd", "momentum", "nesterov", "adagrad"})
STOCK = "stock"


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
    contract = Contract(retained_grads=True, draws=(PLACEMENTS,), model_parts=True)

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
        if getattr(s, "events", ()) or getattr(s, "retain_outputs", False) or getattr(s, "param_hooks", ()):
            return "buffer-lifetime schedules (allocator events, held outputs, parameter hooks) are the graphed paths'"
        if s.optimizer in DTENSOR_UNFUSED and s.optimizer_impl == "fused":
            return f"DTensor has no sharding strategy for fused {s.optimizer} (NotImplementedError on every path)"
        if s.optimizer == "rprop" and (s.optimizer_impl != "for_loop" or mode_of(case) == "dtensor"):
            return ("rprop on DTensor: its foreach form needs _foreach_copy_ (no sharding strategy), its loop form "
                    "an index_put_ DTensor refuses on sharded parameters; run only as a for-loop on Replicate parameters")
        if s.optimizer == "rprop" and not _has_strategy(torch.ops.aten.index_put_.default):
            return ("rprop's loop form needs index_put_, for which this torch's DTensor has no sharding strategy "
                    "(NotImplementedError on every path; 2.13 has one)")
        if mode_of(case) == "dtensor":
            from harness.case.ops import OPS

            plain = sorted({n.op for n in case.nodes if OPS[n.op].plain_tensors})
            if plain:
                return (f"{', '.join(plain)} build(s) a plain index or mask tensor inside the forward: DTensor refuses "
                        f"mixed operands (a DTensor model distributes those too; the to_local pattern takes them)")
            if any(n.op == "sdpa" for n in case.nodes) and self.backend != "nccl":
                return ("scaled_dot_product_attention on CPU DTensors falls back to the math kernel, which builds "
                        "a plain attention bias: DTensor refuses mixed operands")
            if any((p.placement or "partial") == "partial" for p in case.params):
                return "mixes to_local/Partial parameters with DTensor-placed ones"
            if any(p.placement in ("colwise", "rowwise") and not tp_eligible(case, p.name) for p in case.params):
                return "a tensor-parallel style needs a weight used only as the right operand of a matmul (h @ w)"
            if any(n.op == "layout_matmul" and n.attr("layout") == "buffer_view" for n in case.nodes):
                return "a buffer_view grad copies a DTensor into a plain buffer (DTensor refuses mixed operands)"
            sharded = [p.name for p in case.params if p.placement.startswith("shard") or p.placement in ("colwise", "rowwise")]
            thin = [p.name for p in case.params if p.placement.startswith("shard")
                    and p.shape[int(p.placement[5:])] < self._world()]
            writes = (s.grad_init != "none" or s.microbatches > 1 or s.optimizer or s.clip
                      or (s.steps > 1 and s.zero_grad != "set_to_none"))
            expanded = {u.ref for n in case.nodes if n.op == "expand" for u in n.args}
            if set(thin) & expanded:
                return ("expand of a parameter sharded on a dim with fewer elements than ranks: DTensor's sharding "
                        "propagation raises a bare KeyError (torch bug, seen on 2.13: _rewrite_plain_shard)")
            if thin and writes:
                return ("a parameter is sharded on a dim with fewer elements than ranks: DTensor has no in-place "
                        "strategy for it, so accumulating into its .grad raises (torch bug, see cases/dtensor/)")
            if sharded and any(n.op == "reshape" for n in case.nodes):
                return ("a reshape with sharded parameters: DTensor refuses views that would shard a dim unevenly "
                        "(\"Please redistribute the tensor before this operation\", pytorch/pytorch#143372)")
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
            return Repro(template="torchrun", impl=self.impl, world_size=self.world_size)
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

    ws, timeout, backend = options.world_size, options.timeout, options.dtensor_backend
    stock = options.dtensor_impl or STOCK
    made = [DTensorPath("dtensor.stock", stock, ws, timeout, backend), DTensorPath("dtensor.fixed", FIXED, ws, timeout, backend)]
    if pool.torchrun_env():
        made[0].group  # join now: every rank joins at start-up, whatever is fuzzed
    return made


# --- rank facts -> Observation --------------------------------------------------


def observation(name: str, case: Case, outcome: Any) -> Observation:
    obs = Observation(path=name)
    replies = outcome.replies
    obs.extra["seconds"] = outcome.seconds
    ranks = sorted(replies)
    failures = []
    for r in ranks:
        rep = replies[r]
        if "error" in rep:
            failures.append((r, Failure(-1, "WorkerError", rep["error"][:300])))
        elif rep.get("failure"):
            f = rep["failure"]
            failures.append((r, Failure(f["k"], f["type"], f"rank {r}: {f['message']}")))
            obs.extra.setdefault("tracebacks", {})[r] = f.get("traceback", "")
    if failures:
        obs.failure = min(failures, key=lambda rf: (rf[1].k if rf[1].k >= 0 else 10**9, rf[0]))[1]
    if outcome.status == "timeout":
        raised = f"; {obs.failure.message} first" if obs.failure else ""
        obs.violations.append(Violation("timeout", -1, "process group",
                                        f"the case hung (a mismatched collective?){raised}: {outcome.detail}",
                                        key="timeout"))
    elif outcome.status == "crash":
        obs.violations.append(Violation("crash", -1, "process group",
                                         f"a rank died running the case: {outcome.detail}", key="crash"))
    if outcome.status != "ok" or len(ranks) != max(ranks, default=-1) + 1 or obs.failure and not _all_steps(replies):
        if outcome.status == "ok" and obs.failure is None:
            obs.failure = Failure(-1, "WorkerError", "not every rank replied")
        return obs
    world = len(ranks)
    per_rank = [replies[r]["steps"] for r in ranks]
    n_steps = min(len(s) for s in per_rank)
    if len({len(s) for s in per_rank}) > 1 and obs.failure is None:
        obs.failure = Failure(n_steps, "WorkerError", "ranks completed different numbers of backwards")
    local_mode = replies[0].get("mode") == "local"
    problems: set[str] = set()
    for i in range(n_steps):
        steps = [s[i] for s in per_rank]
        k = steps[0]["k"]

        def gather(group: str) -> Grads:
            names = steps[0][group].keys()
            out: Grads = {}
            for n in names:
                out[n] = _assemble(obs, problems, k, f"{_label(group)}{n}", [s[group].get(n) for s in steps], world)
            return out

        outputs = [
            _assemble(obs, problems, k, f"output {j}", [s["outputs"][j] for s in steps], world)
            for j in range(len(steps[0]["outputs"]))
        ]
        obs.steps.append(Step(k=k, grads=gather("grads"), input_grads=gather("input_grads"), outputs=outputs,
                              retained=gather("retained")))
        if "after_step" in steps[0]:
            obs.steps[-1].after_step = {
                n: _assemble(obs, problems, k, f"after step {n}", [s["after_step"].get(n) for s in steps], world)
                for n in steps[0]["after_step"]
            }
        _judge_accumulation(obs, k, steps[0], local_mode, world)
        for r, s in enumerate(steps):
            _judge_layout(obs, problems, k, r, s.get("layout", {}))
    return obs


def _differs(a: tuple, b: tuple, shape: tuple) -> bool:
    return len(a) != len(b) or any(x != y for x, y, n in zip(a, b, shape) if n > 1)


def _judge_layout(obs: Observation, problems: set[str], k: int, rank: int, layout: dict[str, Any]) -> None:
    """The grad layout rule of ``run_schedule`` on every rank: a grad laid out
    like its parameter, locally and in the global stride it declares."""
    for n, f in layout.items():
        if _differs(tuple(f["grad"]), tuple(f["param"]), tuple(f["shape"])):
            _problem(obs, problems, "layout", k, n,
                     f"{n}.grad after backward {k} on rank {rank}: local strides {tuple(f['grad'])}, the parameter's "
                     f"local strides {tuple(f['param'])} (local shape {tuple(f['shape'])}): eager gives .grad its "
                     f"parameter's layout (fused optimizers, clipping and checkpoint code read .grad as laid out "
                     f"like the parameter)", "grad layout differs from the parameter's")
        elif _differs(tuple(f["grad_global"]), tuple(f["param_global"]), tuple(f["global_shape"])):
            _problem(obs, problems, "layout", k, n,
                     f"{n}.grad after backward {k} on rank {rank}: declares global strides {tuple(f['grad_global'])}, "
                     f"the parameter {tuple(f['param_global'])}: a DTensor whose declared layout is not its "
                     f"parameter's misleads full_tensor() and redistribution", "grad declares another global layout")


def _all_steps(replies: dict[int, Any]) -> bool:
    return all("steps" in r for r in replies.values())


def _label(group: str) -> str:
    return {"grads": "", "input_grads": "input grad ", "retained": "retained grad "}[group]


def _assemble(obs: Observation, problems: set[str], k: int, what: str, encs: list[Any], world: int) -> torch.Tensor | None:
    """One tensor from every rank's local shard, by its placements."""
    if all(e is None for e in encs):
        return None
    if any(e is None for e in encs):
        missing = [r for r, e in enumerate(encs) if e is None]
        _problem(obs, problems, "replica", k, what, f"{what} after backward {k}: rank(s) {missing} have none, "
                 f"other ranks do", "missing on some ranks")
        return next(e for e in encs if e is not None)["local"]
    pls = [e["pl"] for e in encs]
    if len(set(pls)) > 1:
        _problem(obs, problems, "placement", k, what,
                 f"{what} after backward {k}: ranks disagree on its placements ({', '.join(f'rank {r}: {p}' for r, p in enumerate(pls))})",
                 "ranks disagree on placements")
        return encs[0]["local"]
    pl = pls[0]
    locs = [e["local"] for e in encs]
    shape = encs[0]["shape"]
    if pl == "R":
        for r in range(1, world):
            if locs[r].shape != locs[0].shape or not torch.equal(locs[r], locs[0]):
                diff = float((locs[r] - locs[0]).abs().max()) if locs[r].shape == locs[0].shape else float("inf")
                _problem(obs, problems, "replica", k, what,
                         f"{what} after backward {k} is Replicate but rank {r}'s copy differs from rank 0's "
                         f"(max abs diff {diff:g}): the replicas have diverged", "replicas differ")
                break
        return locs[0]
    if pl.startswith("P"):
        op = pl[2:-1] if "(" in pl else "sum"
        stacked = torch.stack(locs)
        if op in ("sum",):
            return stacked.sum(0)
        if op == "avg":
            return stacked.mean(0)
        if op == "max":
            return stacked.amax(0)
        if op == "min":
            return stacked.amin(0)
        return stacked.sum(0)
    if pl.startswith("S") and pl[1:].isdigit():
        full = torch.cat(locs, dim=int(pl[1:]))
        if tuple(full.shape) != tuple(shape):
            _problem(obs, problems, "placement", k, what,
                     f"{what} after backward {k}: its Shard({pl[1:]}) pieces make shape {tuple(full.shape)}, "
                     f"its global shape is {tuple(shape)}", "shards do not make the global shape")
            return locs[0]
        return full
    _problem(obs, problems, "placement", k, what,
             f"{what} after backward {k} is {'a plain tensor' if pl == 'plain' else pl}, not a DTensor on the 1-d mesh",
             f"unexpected placement kind {pl}")
    return locs[0]


def _problem(obs: Observation, problems: set[str], kind: str, k: int, what: str, detail: str, key: str) -> None:
    if (kind, what) in problems:
        return
    problems.add((kind, what))  # type: ignore[arg-type]
    obs.violations.append(Violation(kind, k, what, detail, key=key))


# Collectives an in-place ``grad += arriving`` needs on a 1-d mesh, to bring
# the arriving grad to ``.grad``'s placement. A mesh of one rank redistributes
# locally.
def _sum_needs(arrival: str, into: str, world: int) -> int:
    if arrival == into or arrival == "R" or world == 1:
        return 0  # Replicate -> anything is a local slice or a local zeroing
    return 1  # Partial -> Replicate/Shard, Shard -> Replicate/other Shard: one collective


_NAMES = {"R": "Replicate", "P": "Partial(sum)"}


def _long(pl: str | None) -> str:
    if pl is None:
        return "None"
    if pl.startswith("S") and pl[1:].isdigit():
        return f"Shard({pl[1:]})"
    return _NAMES.get(pl, pl)


def _judge_accumulation(obs: Observation, k: int, step: dict[str, Any], local_mode: bool, world: int) -> None:
    """Violations of the AccumulateGrad invariants in rank 0's record of backward ``k``."""
    in_windows = 0
    for n, r in step["acc"].items():
        window = r.get("window", {})
        in_windows += sum(window.values())
        if "post" not in r:
            continue  # the grad arrived but .grad was never updated: a value finding, if any
        arrival, prev, post = r.get("arrival"), r.get("prev"), r["post"]
        if arrival is None:
            continue
        layout = "" if r.get("arrival_contiguous", True) else f", non-contiguous (strides {tuple(r['arrival_stride'])})"
        want = arrival if prev is None else prev
        if post != want:
            why = ("the sum into an existing .grad keeps .grad's placement" if prev is not None
                   else "Partial must survive until the user reduces it" if arrival.startswith("P")
                   else "accumulating into an empty .grad must not change the placement")
            obs.violations.append(Violation(
                "placement", k, n,
                f"{n}.grad is {_long(post)} after backward {k}, expected {_long(want)}: the grad reached "
                f"AccumulateGrad as {_long(arrival)}{layout} and .grad was {_long(prev)}; {why}",
                key=f"placement {arrival}->{post} into {prev} contiguous={r.get('arrival_contiguous')}"))
        need = 0 if prev is None else _sum_needs(arrival, prev, world)
        got = sum(window.values())
        if got != need:
            ops = ", ".join(f"{v} {op}" for op, v in sorted(window.items())) or "none"
            obs.violations.append(Violation(
                "collective", k, n,
                f"AccumulateGrad for {n} issued {ops} in backward {k}; expected {need or 'none'} (the grad "
                f"arrived {_long(arrival)}{layout}, .grad was {_long(prev)}, and became {_long(post)})",
                key=f"collective {sorted(window)} {arrival} into {prev}"))
    outside = sum(step["collectives"].values()) - in_windows
    if local_mode and outside > 0:
        obs.violations.append(Violation(
            "collective", k, "backward",
            f"backward {k} issued {outside} collective(s) outside AccumulateGrad ({step['collectives']}); "
            f"expected none: every parameter is used through to_local(grad_placements=[Partial()])",
            key="collective outside AccumulateGrad in local mode"))
