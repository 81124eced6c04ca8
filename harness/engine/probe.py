"""The observation probe: one small case per observation,
run on a path to see which observations it makes. A test holds every family
to its contract with it; ``benchmarks/observations.py`` counts them per
family in this checkout or an older one."""

from __future__ import annotations

from typing import Any, Callable

from harness.case.spec import Case, Hook, Input, Node, Param, Schedule, Use
from harness.paths import families
from harness.paths.base import Options

try:
    from harness.observation import GRAD_NONE
except ImportError:  # an older checkout, measured by benchmarks/observations.py
    GRAD_NONE = "None versus zeros"


def probe_case(frozen: bool = False, cut: bool = True) -> Case:
    """``x0 @ w0 @ w2 @ w3 @ w4`` beside a ``u1`` that eager leaves None:
    unused, or (for machinery that refuses unused parameters, as DDP
    documents) frozen and used; cut into pipeline stages or whole, each
    family's part of it as the family declares it (``Family.probe_data``)."""
    nodes = tuple(Node(f"n{i}", "matmul", (Use(f"n{i - 1}" if i else "x0"), Use(w)))
                  for i, w in enumerate(("w0", "w2", "w3", "w4")))
    if frozen:
        nodes += (Node("n4", "matmul", (Use("n3"), Use("u1"))),)
    params = (Param("w0", (3, 3)), Param("u1", (3, 3), requires_grad=not frozen),
              *(Param(w, (3, 3)) for w in ("w2", "w3", "w4")))
    case = Case(params=params, inputs=(Input("x0", (2, 3), requires_grad=True),), nodes=nodes,
                outputs=(Use(nodes[-1].name),), schedule=Schedule(microbatches=2))
    for fam in families():  # older checkouts' families declare none
        value = getattr(fam, "probe_data", lambda cut: None)(cut)
        if value is not None:
            data = case.to_json()
            data["family"] = {**data.get("family", {}), fam.name: value}
            try:
                case = Case.from_json(data)
            except ValueError:
                pass
    return case


# Each observation whose making shows in what a path returns: what gives it
# something to show, added to the probe case, and how it shows.
def probes() -> dict[str, tuple[Callable[[Case], Case], Callable[[Any], bool]]]:
    def same(case: Case) -> Case:
        return case

    def schedule(**kw: Any) -> Callable[[Case], Case]:
        return lambda case: Case(**{**case.__dict__, "schedule": Schedule(microbatches=2, **kw)})

    return {
        "grad values": (same, lambda obs: any(s.grads and s.grads.get("w0") is not None for s in obs.steps)),
        GRAD_NONE: (same, lambda obs: all(s.grads is None or "u1" in s.grads and s.grads["u1"] is None
                                          for s in obs.steps)),
        "input .grad": (same, lambda obs: any(g is not None for s in obs.steps
                                              for g in (s.input_grads or {}).values())),
        "recomputation count": (same, lambda obs: any(v for s in obs.steps for k, v in (s.recomputed or {}).items()
                                                      if k.endswith(" backward"))),
        "retained grads": (lambda case: Case(**{**case.__dict__, "retain_grad": ("n0",)}),
                           lambda obs: any(s.retained.get("n0") is not None for s in obs.steps)),
        "hook-firing count": (lambda case: Case(**{**case.__dict__, "hooks": (Hook("n0"),)}),
                              lambda obs: any(s.fired and "n0 tensor_hook" in s.fired for s in obs.steps)),
        "hook-kept grads": (schedule(param_hooks=("hook",)), lambda obs: any(s.seen for s in obs.steps)),
        "optimizer state": (schedule(optimizer="sgd"), lambda obs: any(s.after_step for s in obs.steps)),
        "RNG state": (_dropout, lambda obs: any(s.rng is not None for s in obs.steps)),
    }


def _dropout(case: Case) -> Case:
    nodes = case.nodes + (Node("d0", "dropout", (Use(case.nodes[-1].name),)),)
    return Case(**{**case.__dict__, "nodes": nodes, "outputs": (Use("d0"),)})


def probe_for(path: Any, add: Callable[[Case], Case]) -> tuple[Case | None, str]:
    """The first probe shape the path takes with the observation's trigger
    added, or None and the path's reason for refusing the last one."""
    why = ""
    for frozen in (False, True):
        for cut in (True, False):
            case = add(probe_case(frozen, cut))
            why = path.supports(case)
            if why is None:
                return case, ""
    return None, why


def kinds(family: str) -> list[Any]:
    """The family's available paths, one per kind of machinery (class,
    ranks and blind spots): a schedule's 28 pipeline paths are two kinds."""
    seen, out = set(), []
    fam = next(f for f in families() if f.name == family)
    own_cases = getattr(fam, "unprobed", {})  # paths the probe cannot speak for (older checkouts: none)
    for path in fam.paths(Options()):
        key = (type(path).__name__, getattr(path, "world_size", 1), _blind(path))
        if key not in seen and type(path).__name__ not in own_cases and path.availability().ok:
            seen.add(key)
            out.append(path)
    return out


def survey(path: Any) -> dict[str, str]:
    """Each probed observation on ``path``: "made", "blind" (declared),
    "not made", "refused: WHY" or "failed: WHAT"."""
    blind = _blind(path)
    out = {}
    for name, (add, shows) in probes().items():
        if name in blind:
            out[name] = "blind"
            continue
        case, why = probe_for(path, add)
        if case is None:
            out[name] = f"refused: {why}"
            continue
        obs = path.run(case)
        out[name] = f"failed: {obs.failure}" if obs.failure is not None else "made" if _shows(shows, obs) else "not made"
    return out


def _blind(path: Any) -> frozenset[str]:
    """What the contract declares blind (nothing in checkouts older than Contract.blind_to)."""
    return path.contract.blind_to() if hasattr(path.contract, "blind_to") else frozenset()


def _shows(shows: Callable[[Any], bool], obs: Any) -> bool:
    try:
        return shows(obs)
    except AttributeError:  # an older checkout's Observation has no such field: not made there
        return False
