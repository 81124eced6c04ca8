"""The mesh family's part of a case: where each parameter lives on the 2-D
("dp", "tp") mesh, one code per parameter in the case's order.

A code is ``"<dp>,<tp>"`` with each part ``R`` (Replicate) or ``S<d>``
(Shard(d)), and the tp part may instead be a tensor-parallel style,
``colwise`` or ``rowwise`` (only for a weight used as the plain right operand
of a matmul). ``mesh.dtensor2d`` places parameters by the codes (a style as
the Shard it makes of the case's ``w``: colwise ``S1``, rowwise ``S0``);
``mesh.fsdp_tp`` reads only the styles (every other parameter is Replicate
over "tp", and FSDP2 shards everything over "dp").

``partial_dp``: ``mesh.dtensor2d`` hands each dp group its own share of every
grad output as a ``(Partial(), Replicate())`` DTensor (the shares sum to the
case's grad output), so grads arrive Partial over "dp", as data parallelism
written in DTensors has them; off, grad outputs are Replicate on both dims.
``mesh.fsdp_tp`` always splits grad outputs over "dp" and ignores it.

``mesh.pp_dp`` (a ("pp", "dp") mesh) reads no codes (``codes`` may be
empty); its stages are the pipeline family's cuts (``family.pipeline``) and
its own knobs are ``schedule`` (the torch.distributed.pipelining schedule,
``""`` for ``GPipe``) and ``wrapper`` (the data-parallel wrapper of each
stage over "dp", ``""`` for ``ddp``, or ``fsdp2``).

The family's own draws are here too: a placement on each of the two mesh
dims per parameter, then maybe a training step; for ``mesh.pp_dp``, a
pipeline layout and a data-parallel wrapper (``Contract.draws``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hypothesis import strategies as st

from harness.case import schema as sc
from harness.case.namespace import DataNamespace
from harness.case.spec import Case
from harness.case.vocab import SpecError
from harness.generate import Draw, tp_eligible, training_steps

STYLES = ("colwise", "rowwise")
DIM_SIZES = (2, 2)  # the mesh: ("dp", "tp")
MESH_DIMS = ("dp", "tp")
PP_DP_DIMS = ("pp", "dp")  # mesh.pp_dp's mesh, of the same sizes
PP_SCHEDULES = ("GPipe", "1F1B")  # the first is the default ("")
DP_WRAPPERS = ("ddp", "fsdp2")


@dataclass(frozen=True)
class Placements:
    codes: tuple[str, ...] = ()
    partial_dp: bool = False
    schedule: str = ""  # mesh.pp_dp: "" (GPipe) or another of PP_SCHEDULES
    wrapper: str = ""  # mesh.pp_dp: "" (ddp) or fsdp2


def pp_schedule(case: Case) -> str:
    data = case.data("mesh")
    return (data.schedule if data is not None else "") or PP_SCHEDULES[0]


def dp_wrapper(case: Case) -> str:
    data = case.data("mesh")
    return (data.wrapper if data is not None else "") or DP_WRAPPERS[0]


def partial_dp(case: Case) -> bool:
    data = case.data("mesh")
    return bool(data is not None and data.partial_dp)


def placements(case: Case) -> tuple[str, ...]:
    """One code per parameter ("R,R" where the case has none)."""
    data = case.data("mesh")
    return data.codes if data is not None and data.codes else tuple("R,R" for _ in case.params)


def split(code: str) -> tuple[str, str]:
    dp, _, tp = code.partition(",")
    return dp, tp


def _part(v: str, where: str, ndim: int, styles: bool) -> None:
    if v == "R" or (styles and v in STYLES):
        return
    if v.startswith("S") and v[1:].isdigit() and int(v[1:]) < ndim:
        return
    raise SpecError(where, f"expected R or S<d> with d below the parameter's {ndim} dim(s)"
                    + (" or a style (colwise, rowwise)" if styles else "") + f", got {v!r}")


def _codes(v: Any, where: str) -> tuple[str, ...]:
    return tuple(sc.string(x, f"{where}[{i}]", max_len=16) for i, x in enumerate(sc.array(v, where)))


def _check(case: Case, value: Placements, where: str) -> None:
    if value.codes and len(value.codes) != len(case.params):
        raise SpecError(f"{where}.codes", f"one code per parameter: {len(case.params)} parameter(s), "
                        f"{len(value.codes)} code(s)")
    for i, (p, code) in enumerate(zip(case.params, value.codes)):
        if code.count(",") != 1:
            raise SpecError(f"{where}.codes[{i}]", f"expected '<dp>,<tp>', got {code!r}")
        dp, tp = split(code)
        _part(dp, f"{where}.codes[{i}]", len(p.shape), styles=False)
        _part(tp, f"{where}.codes[{i}]", len(p.shape), styles=True)


def _choice(options: tuple[str, ...]):  # type: ignore[no-untyped-def]
    return lambda v, where: sc.string(v, where, max_len=16, choices=("",) + options)


CASE_DATA = DataNamespace("mesh", Placements, {"codes": _codes, "partial_dp": sc.boolean,
                                               "schedule": _choice(PP_SCHEDULES), "wrapper": _choice(DP_WRAPPERS)},
                          check=_check)


MAX_MICROBATCHES = 4  # as the pipeline family probes its layouts


def min_microbatches(schedule: str) -> int:
    """Schedule1F1B's constructor refuses fewer microbatches than stages (2 here)."""
    return 2 if schedule == "1F1B" else 1


@st.composite
def mesh_placements(draw, case: Case) -> Case:
    """Each parameter's dp and tp placements, and whether grad outputs are
    Partial over "dp"; shrinks to Replicate grad outputs and parameters
    (then the namespace is dropped: that is the default)."""
    codes = []
    for p in case.params:
        dims = tuple(f"S{d}" for d in range(len(p.shape)))
        dp = draw(st.sampled_from(("R",) + dims))
        tp = draw(st.sampled_from(("R",) + dims + (STYLES if tp_eligible(case, p.name) else ())))
        codes.append(f"{dp},{tp}")
    partial = draw(st.booleans())
    data = Placements(tuple(codes), partial)
    case = case.with_data("mesh", data if partial or any(c != "R,R" for c in codes) else None)
    return draw(training_steps(case))


MESH = Draw("mesh", (mesh_placements,))


@st.composite
def pp_dp_layout(draw, case: Case) -> Case:
    """``mesh.pp_dp``: a schedule and a data-parallel wrapper (mesh case
    data), one cut into two pipeline stages (the pipeline family's
    ``family.pipeline.cuts``) and microbatches the schedule takes; about one
    parameter in five frozen, as the pipeline family draws them. Shrinks to
    GPipe, DDP, the earliest cut and the fewest microbatches."""
    from harness.registry import namespace

    schedule = draw(st.sampled_from(PP_SCHEDULES))
    wrapper = draw(st.sampled_from(DP_WRAPPERS))
    microbatches = draw(st.integers(min_microbatches(schedule), MAX_MICROBATCHES))
    frozen = draw(st.lists(st.integers(0, 4), min_size=len(case.params), max_size=len(case.params)))
    params = tuple(replace(p, requires_grad=False) if f == 4 else p for p, f in zip(case.params, frozen))
    case = replace(case, params=params, schedule=replace(case.schedule, microbatches=microbatches))
    if len(case.nodes) > 1:
        at = 1 + draw(st.integers(0, len(case.nodes) - 2))
        case = case.with_data("pipeline", namespace("pipeline").cls((at,)))
    else:  # one node: one stage, outside the contract (skipped)
        case = case.with_data("pipeline", None)
    data = Placements((), False, "" if schedule == PP_SCHEDULES[0] else schedule,
                      "" if wrapper == DP_WRAPPERS[0] else wrapper)
    return case.with_data("mesh", data if data != Placements() else None)


PP_DP = Draw("mesh_pp_dp", (pp_dp_layout,))
