"""Observation pairs -> Divergences a person can act on.

Exact mode: any difference is a bug. Tolerance mode: each element's
tolerance is proportional to the size of the terms summed into it
(``magnitude_bounds``), never one global epsilon. A value divergence says
how many elements differ, the largest absolute and relative difference, a
fitted ratio (2.0 = counted twice) and, where the actual grad is a clean
combination of the per-microbatch grads, which combination
("2*g2 instead of g1 + g2" is a stale buffer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.build import magnitude_bounds
from harness.observation import Divergence, Observation, signature
from harness.paths.base import Contract
from harness.spec import Case

EPS = {"float32": 2.0**-23, "float64": 2.0**-52}
SLACK = 128  # rounding steps allowed per unit of term magnitude


@dataclass(frozen=True)
class Tolerance:
    exact: bool
    eps: float
    bounds: dict[str, torch.Tensor]
    peak: float

    @classmethod
    def for_case(cls, case: Case, slack: float = SLACK) -> "Tolerance":
        eps = EPS[case.dtype] * slack
        if case.exact:
            return cls(True, 0.0, {}, 0.0)
        b = magnitude_bounds(case)
        return cls(False, eps, b, float(b.pop("__peak__")))

    def allowed(self, what: str, shape: torch.Size) -> torch.Tensor | float:
        if self.exact:
            return 0.0
        bound = self.bounds.get(what)
        if bound is not None and bound.shape == shape:
            return self.eps * bound + self.eps * 1e-3 * self.peak + 1e-30
        return self.eps * self.peak + 1e-30


def compare(case: Case, oracle: Observation, obs: Observation, contract: Contract, tol: Tolerance | None = None) -> list[Divergence]:
    tol = tol or Tolerance.for_case(case)
    found: list[Divergence] = []
    if obs.failure is not None:
        f = obs.failure
        what = f"{f.type}: {f.message}"
        found.append(
            Divergence(obs.path, "error", None, f.k if f.k >= 0 else None, None, None, None,
                       f"raised {what} (the eager oracle ran this case fine)",
                       signature(obs.path, "error", what))
        )
    for m in obs.mutations:
        what = f"changed {m.what}"
        found.append(
            Divergence(obs.path, "mutation", None, m.k, m.max_abs, None, None,
                       f"{m.what} changed by up to {m.max_abs:g} during backward {m.k}, but nobody wrote to it",
                       signature(obs.path, "mutation", m.what.split(" ")[0]))
        )
    for v in obs.violations:
        found.append(
            Divergence(obs.path, v.kind, v.what, v.k, None, None, None, v.detail,
                       signature(obs.path, v.kind, v.key or v.what))
        )
    done: set[str] = set()
    for o_step, p_step in zip(oracle.steps, obs.steps):
        k = o_step.k
        groups = [("param", o_step.grads, p_step.grads), ("input grad", o_step.input_grads, p_step.input_grads)]
        if contract.retained_grads:
            groups.append(("retained grad", o_step.retained, p_step.retained))
        outs = {f"output {i}": t for i, t in enumerate(o_step.outputs)}
        p_outs = {f"output {i}": t for i, t in enumerate(p_step.outputs)}
        groups.append(("output", outs, p_outs))
        for role, expected, actual in groups:
            for name, e in expected.items():
                key = f"{role}:{name}"
                if key in done:
                    continue
                a = actual.get(name)
                d = _value(case, obs.path, role, name, k, e, a, tol, oracle)
                if d is not None:
                    done.add(key)
                    found.append(d)
    return found


def _value(case, path, role, name, k, e, a, tol: Tolerance, oracle: Observation) -> Divergence | None:
    label = name if role in ("param", "output") else f"{role} {name}"
    if e is None and a is None:
        return None
    if e is None or a is None:
        present = a if e is None else e
        if float(present.abs().max()) == 0 if present.numel() else True:
            return None  # None and an all-zero grad mean the same to a user
        if a is None:
            detail = f"{label}: no grad after backward {k}, expected max |grad| {float(e.abs().max()):g}"
            return Divergence(path, "value", label, k, float(e.abs().max()), 1.0, 0.0, detail,
                              signature(path, "value", f"{role} missing"))
        detail = f"{label}: got a grad after backward {k} where autograd gives none (max {float(a.abs().max()):g})"
        return Divergence(path, "value", label, k, float(a.abs().max()), None, None, detail,
                          signature(path, "value", f"{role} unexpected"))
    if e.shape != a.shape:
        detail = f"{label}: shape {tuple(a.shape)} after backward {k}, expected {tuple(e.shape)}"
        return Divergence(path, "value", label, k, None, None, None, detail, signature(path, "value", f"{role} shape"))
    diff = (a - e).abs()
    allowed = tol.allowed(name if role == "param" else "", e.shape)
    bad = diff > allowed
    if not bool(bad.any()):
        return None
    max_abs = float(diff.max())
    rel = diff / e.abs().clamp_min(1e-30)
    max_rel = float(rel[bad].max())
    ee = float((e * e).sum())
    ratio = float((a * e).sum()) / ee if ee > 0 else None
    at = tuple(int(i) for i in torch.nonzero(bad)[0]) if e.dim() else ()
    explain = _explain(case, role, name, k, a, oracle) if role == "param" else ""
    tol_txt = "exact mode: any difference is a bug" if tol.exact else f"tolerance {tol.eps:.1e} x term size"
    detail = (
        f"{label} after backward {k}: {int(bad.sum())} of {e.numel()} elements differ; "
        f"max abs diff {max_abs:g}, max rel diff {max_rel:g} (first at index {at}: "
        f"expected {float(e[at]):g}, got {float(a[at]):g}; {tol_txt})"
        + (f"; ratio actual/expected {ratio:.4g}" if ratio is not None else "")
        + (f"; {explain}" if explain else "")
    )
    shape_of_bug = _ratio_class(ratio) + (" " + explain.split(" (")[0] if explain else "")
    return Divergence(path, "value", label, k, max_abs, max_rel, ratio, detail,
                      signature(path, "value", f"{role} {shape_of_bug}"))


def _ratio_class(ratio: float | None) -> str:
    if ratio is None:
        return "ratio=none"
    nearest = round(ratio * 2) / 2
    return f"ratio~{nearest:g}" if abs(ratio - nearest) < 0.02 else "ratio=irregular"


def _explain(case: Case, role: str, name: str, k: int, actual: torch.Tensor, oracle: Observation) -> str:
    """Express the actual grad as a combination of per-backward grads, if it is one."""
    m = case.schedule.microbatches
    start = 0 if case.schedule.zero_grad == "keep" else (k // m) * m
    terms: list[tuple[str, torch.Tensor]] = []
    for j in range(start, k + 1):
        g = oracle.contributions[j].get(name)
        if g is not None:
            terms.append((f"g{j + 1}", g))
    if not terms or len(terms) > 8:
        return ""
    A = torch.stack([t.reshape(-1) for _, t in terms], dim=1)
    y = actual.reshape(-1, 1)
    init = y.new_zeros(y.shape)
    if case.schedule.grad_init == "prefilled" and start == 0:
        # The prefilled grad is a known constant part of the expected value.
        init = (oracle.steps[k].grads[name].reshape(-1, 1) - A.sum(dim=1, keepdim=True))
    try:
        coef = torch.linalg.lstsq(A, y - init).solution.reshape(-1)
    except RuntimeError:
        return ""
    if float((A @ coef.reshape(-1, 1) + init - y).abs().max()) > 1e-6 * (1 + float(y.abs().max())):
        return ""
    rounded = [round(float(c), 3) for c in coef]
    if all(abs(c - 1) < 1e-6 for c in rounded):
        return ""
    parts = [f"{c:g}*{lbl}" for c, (lbl, _) in zip(rounded, terms) if abs(c) > 1e-9] or ["0"]
    got = " + ".join(parts)
    want = " + ".join(lbl for lbl, _ in terms)
    note = ""
    nonzero = [(c, lbl) for c, (lbl, _) in zip(rounded, terms) if abs(c) > 1e-9]
    if len(terms) > 1 and len(nonzero) == 1 and nonzero[0][1] == terms[-1][0]:
        note = f" (the last backward's grad counted {nonzero[0][0]:g} times: a stale or overwritten buffer)"
    return f"actual = {got}, expected {want}{note}"
