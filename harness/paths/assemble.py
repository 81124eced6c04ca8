"""Rank facts to one Observation: the grads every rank reported put back
together (summing Partial, checking replicas agree, concatenating shards),
with the placement, replica, layout and accumulation rules of a process
group checked on the way. Written once for every rank-based family (DTensor,
DDP, FSDP2, DeepSpeed)."""

from __future__ import annotations

from typing import Any

import torch

from harness.case.spec import Case
from harness.observation import Failure, Grads, Observation, Step, Violation


def _first_failure(obs: Observation, replies: dict[int, Any]) -> None:
    """The failure of the earliest backward (then the lowest rank) is the
    finding: what other ranks raised after it may be its consequence."""
    failures = []
    for r in sorted(replies):
        rep = replies[r]
        if "error" in rep:
            failures.append((r, Failure(-1, "WorkerError", rep["error"][:300])))
        elif rep.get("failure"):
            f = rep["failure"]
            failures.append((r, Failure(f["k"], f["type"], f"rank {r}: {f['message']}")))
            obs.extra.setdefault("tracebacks", {})[r] = f.get("traceback", "")
    if failures:
        obs.failure = min(failures, key=lambda rf: (rf[1].k if rf[1].k >= 0 else 10**9, rf[0]))[1]


def observation(name: str, case: Case, outcome: Any) -> Observation:
    obs = Observation(path=name)
    replies = outcome.replies
    obs.extra["seconds"] = outcome.seconds
    ranks = sorted(replies)
    _first_failure(obs, replies)
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
        # A backward whose grads the stack keeps out of sight (inside an
        # accumulation window) says so; compare skips grads of None.
        grads = gather("grads") if steps[0].get("observable", True) else None
        obs.steps.append(Step(k=k, grads=grads, input_grads=gather("input_grads"), outputs=outputs,  # type: ignore[arg-type]
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
    for n, r in step.get("acc", {}).items():  # AccumulateGrad records: the DTensor ranks keep them
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
    outside = sum(step.get("collectives", {}).values()) - in_windows
    if local_mode and outside > 0:
        obs.violations.append(Violation(
            "collective", k, "backward",
            f"backward {k} issued {outside} collective(s) outside AccumulateGrad ({step['collectives']}); "
            f"expected none: every parameter is used through to_local(grad_placements=[Partial()])",
            key="collective outside AccumulateGrad in local mode"))
