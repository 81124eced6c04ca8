"""``torchtitan.tp.stock``: torchtitan's own Llama (``Llama3Model`` from a
generated config) under torchtitan's tensor-parallel and sequence-parallel
plan, on the worker pool's two ranks (gloo on CPU), trained with its
gradient accumulation and loss. What each rank runs is ``tp_rank``.

Why not the case's module: torchtitan's TP plan is keyed on Llama's modules
(``attention.qkv_linear.wqkv``, ``feed_forward.w1``, the norms, the
vocab-parallel embedding and lm_head, declared in ``set_llama3_sharding_config``)
and applies to nothing else. So this path builds the Llama the case's
``family.torchtitan`` knobs describe and judges it against a float64 eager
run of the same Llama, which the ranks make themselves: the core case's
eager oracle says nothing about a Llama. The path reads only the case's
schedule from the core case (microbatches per step, steps); it returns
one step per backward whose grads, input grads and outputs are "not
observable" for the core case (compare skips them), and every Llama grad
that differs from float64 as a violation of kind ``grad`` naming the
parameter, its micro-step and the numbers.
"""

from __future__ import annotations

from typing import Any

from harness.case.spec import Case
from harness.observation import Failure, Observation, Step, Violation
from harness.paths.base import Availability, Contract, Repro
from harness.paths.engine_rules import replay_only
from harness.paths.pooled import PooledPath
from harness.paths.torchtitan.data import LLAMA, trainer_refusal
from harness.paths.torchtitan.paths import BLIND, warm

STOCK = "stock"


class TorchtitanTPPath(PooledPath):
    # The core case's retained grads, hooks and outputs are not this path's:
    # its steps leave them unobserved (None), and say so here.
    contract = Contract(retained_grads=False, draws=(LLAMA,), random_ops=False, blind=BLIND)

    def __init__(self, name: str, impl: str = STOCK, world_size: int = 2, timeout: float = 60.0,
                 backend: str | None = None) -> None:
        super().__init__(name, world_size, timeout, backend)
        self.impl = impl

    def availability(self) -> Availability:
        from harness.paths.torchtitan.paths import TorchtitanPath

        base = TorchtitanPath(self.name, "none", world_size=self.world_size, backend=self.backend).availability()
        if not base.ok:
            return base
        if self.world_size != 2:
            return Availability(False, f"the generated Llama is drawn for two TP ranks (heads, FFN width, sequence "
                                       f"and vocabulary even), not {self.world_size}")
        return Availability(True, base.reason.replace("torchtitan FSDP2, AC none", "torchtitan Llama3, TP/SP plan"))

    def supports(self, case: Case) -> str | None:
        if reason := trainer_refusal(case):
            return reason
        if case.schedule.param_hooks:
            return "parameter hooks belong to the core case's parameters, which the Llama does not have"
        return None

    def run(self, case: Case) -> Observation:
        warm(self.group)
        outcome = self.group.request({"op": "call", "module": "harness.paths.torchtitan.tp.rank",
                                      "case": case.dumps(), "impl": self.impl}, self.timeout)
        return observation(self.name, case, outcome)

    def repro(self, case: Case) -> Repro:
        return replay_only(self.name)


def observation(name: str, case: Case, outcome: Any) -> Observation:
    """The ranks' replies as one Observation: a failure (the earliest backward's,
    then the lowest rank's), a hang or crash, or the violations the ranks found
    (each parameter and micro-step once; every rank holds the same full grads)."""
    obs = Observation(path=name)
    obs.extra["seconds"] = outcome.seconds
    replies = outcome.replies
    if outcome.status == "timeout":
        obs.violations.append(Violation("timeout", -1, "process group", f"the case hung: {outcome.detail}",
                                        key="timeout"))
    elif outcome.status == "crash":
        obs.violations.append(Violation("crash", -1, "process group", f"a rank died running the case: "
                                                                     f"{outcome.detail}", key="crash"))
    failures = []
    for r in sorted(replies):
        rep = replies[r]
        if "error" in rep:
            failures.append((10**9, r, Failure(-1, "WorkerError", rep["error"][:300])))
        elif rep.get("failure"):
            f = rep["failure"]
            failures.append((f["k"] if f["k"] >= 0 else 10**9, r, Failure(f["k"], f["type"], f"rank {r}: {f['message']}")))
            obs.extra.setdefault("tracebacks", {})[r] = f.get("traceback", "")
    if failures:
        obs.failure = min(failures, key=lambda t: t[:2])[2]
    if outcome.status != "ok":
        return obs
    if len(replies) != case_world(replies) and obs.failure is None:
        obs.failure = Failure(-1, "WorkerError", "not every rank replied")
        return obs
    seen = set()
    for r in sorted(replies):
        for v in replies[r].get("violations", ()):
            if (v["k"], v["what"]) not in seen:
                seen.add((v["k"], v["what"]))
                obs.violations.append(Violation("grad", v["k"], v["what"], v["detail"], key=v["key"],
                                                excess=v.get("excess")))
    obs.extra["margin"] = max((rep.get("margin", 0.0) for rep in replies.values()), default=0.0)
    done = min((rep.get("steps", 0) for rep in replies.values()), default=0)
    obs.steps = [Step(k=j, grads=None, input_grads=None, outputs=None, retained=None)  # type: ignore[arg-type]
                 for j in range(done)]
    return obs


def case_world(replies: dict[int, Any]) -> int:
    return max(replies, default=-1) + 1


def paths(world_size: int, timeout: float, backend: str | None) -> list[TorchtitanTPPath]:
    return [TorchtitanTPPath("torchtitan.tp.stock", STOCK, world_size, max(timeout, 60.0), backend)]
