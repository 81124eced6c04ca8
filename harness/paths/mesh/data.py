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
``mesh.fsdp_tp`` always splits grad outputs over "dp" and ignores it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.case import schema as sc
from harness.case.namespace import DataNamespace
from harness.case.spec import Case
from harness.case.vocab import SpecError

STYLES = ("colwise", "rowwise")
DIM_SIZES = (2, 2)  # the mesh: ("dp", "tp")
MESH_DIMS = ("dp", "tp")


@dataclass(frozen=True)
class Placements:
    codes: tuple[str, ...] = ()
    partial_dp: bool = False


def partial_dp(case: Case) -> bool:
    data = case.data("mesh")
    return bool(data is not None and data.partial_dp)


def placements(case: Case) -> tuple[str, ...]:
    """One code per parameter ("R,R" where the case has none)."""
    data = case.data("mesh")
    return data.codes if data is not None else tuple("R,R" for _ in case.params)


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
    if len(value.codes) != len(case.params):
        raise SpecError(f"{where}.codes", f"one code per parameter: {len(case.params)} parameter(s), "
                        f"{len(value.codes)} code(s)")
    for i, (p, code) in enumerate(zip(case.params, value.codes)):
        if code.count(",") != 1:
            raise SpecError(f"{where}.codes[{i}]", f"expected '<dp>,<tp>', got {code!r}")
        dp, tp = split(code)
        _part(dp, f"{where}.codes[{i}]", len(p.shape), styles=False)
        _part(tp, f"{where}.codes[{i}]", len(p.shape), styles=True)


CASE_DATA = DataNamespace("mesh", Placements, {"codes": _codes, "partial_dp": sc.boolean}, check=_check)
