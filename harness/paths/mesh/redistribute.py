"""A redistribution torch's DTensor before 2.13 cannot do: Shard to Partial.

``mesh.dtensor2d`` (both variants) runs the forward on DTensors. DTensor's
pointwise strategy for ``add`` follows one operand, the one with the most
shards (ties: more dims, then the first), and redistributes the other to its
placements, Partial included (``add`` is linear). Where the followed operand
is Partial on a mesh dim on which the other is sharded, torch before 2.13
raises ``redistribute from S(1) to P(sum) not supported yet``
(``torch.distributed.tensor._redistribute``); 2.13 runs the same case.

The shape that shows it: ``x0 @ w0 + x0 @ w0.mT`` with ``w0`` placed
``S0,S1``: ``x0 @ w0`` is ``(Partial, Shard(1))`` (dp shards the contracted
dim, tp the columns), ``x0 @ w0.mT`` is ``(Shard(1), Partial)``; both have one
sharded dim, so the add follows the first and asks dp to turn ``Shard(1)``
into ``Partial`` (found on 2.11 by ``gradfuzz fuzz --paths mesh.dtensor2d.fixed
--seed 1``, mesh.fixed-error-4d5d1aa689, gloo and NCCL; 2.13 agrees).

``shard_to_partial_add`` predicts it from the case: it follows each value's
placement pair through the ops whose DTensor strategy is plain (inputs
Replicate, parameters by their codes, ``.mT`` uses, 2-d ``matmul``, ``add``,
the unary pointwise ops) and gives up (no refusal) on anything else, so it
refuses only cases that reach such an ``add`` through those ops. The backward
is not modelled: the forward raises first in the cases seen.
"""

from __future__ import annotations

from harness.case.spec import Case, Use
from harness.paths.mesh.data import MESH_DIMS, placements, split

Pair = tuple[str, ...]  # one placement per mesh dim: "R", "P" or "S<d>"

_TP_STYLE = {"colwise": "S1", "rowwise": "S0"}
# Unary pointwise ops without linearity in DTensor: a Partial input is reduced first, the output is Replicate there.
_NONLINEAR_UNARY = {"relu", "gelu", "silu", "tanh"}


def _transposed(pair: Pair, ndim: int) -> Pair:
    swap = {f"S{ndim - 1}": f"S{ndim - 2}", f"S{ndim - 2}": f"S{ndim - 1}"}
    return tuple(swap.get(p, p) for p in pair)


def _mm(a: str, b: str) -> str | None:
    """One mesh dim of a 2-d ``a @ b``: the output placement DTensor's mm strategy
    picks at no communication (an operand's Replicate is chunked locally), or
    None where more than one strategy would need communication."""
    table = {("R", "R"): "R", ("R", "S1"): "S1", ("R", "S0"): "P", ("S0", "R"): "S0", ("S1", "R"): "P",
             ("S1", "S0"): "P"}
    return table.get((a, b))


def _shards(pair: Pair) -> int:
    return sum(p.startswith("S") for p in pair)


def _add(a: tuple[Pair, int], b: tuple[Pair, int]) -> tuple[Pair | None, int | None]:
    """``a + b``: (its placements, None), or (None, the mesh dim that would
    need a Shard turned Partial). DTensor follows the operand with the most
    shards, then the most dims, then the first."""
    (pa, na), (pb, nb) = a, b
    first = (_shards(pa), na) >= (_shards(pb), nb)
    (followed, nf), (other, _) = (a, b) if first else (b, a)
    for i, (f, o) in enumerate(zip(followed, other)):
        if f == "P" and o.startswith("S"):
            return None, i
    n = max(na, nb)
    return tuple(f"S{int(f[1:]) + n - nf}" if f.startswith("S") else f for f in followed), None


def _either_order(a: tuple[Pair, int], b: tuple[Pair, int]) -> tuple[Pair | None, int | None]:
    """An accumulation in autograd's input buffer, whose operand order this does not model: it
    raises if either order would."""
    out, dim = _add(a, b)
    if dim is None:
        dim = _add(b, a)[1]
    return (None, dim) if dim is not None else (out, None)


def shard_to_partial_add(case: Case) -> str | None:
    """Where DTensor (torch < 2.13) would have to redistribute a Shard into a
    Partial: "n2 (mesh dim dp)" for a forward ``add``, "the grad of x0 (mesh
    dim tp)" for a backward sum of grad contributions; None if none is
    predicted."""
    from harness.case.validate import infer_shapes
    from harness.paths.mesh.data import partial_dp

    try:
        shapes = infer_shapes(case)
    except Exception:
        return None
    values: dict[str, Pair | None] = {x.name: ("R", "R") for x in case.inputs}
    for p, code in zip(case.params, placements(case)):
        dp, tp = split(code)
        values[p.name] = (dp, _TP_STYLE.get(tp, tp))

    def ndim(ref: str) -> int | None:
        shape = shapes.get(ref)
        if shape is None or (shape and isinstance(shape[0], tuple)):
            return None
        return len(shape)

    def use(u: Use) -> tuple[Pair, int] | None:
        pair, n = values.get(u.ref), ndim(u.ref)
        if pair is None or n is None or u.index is not None:
            return None
        if u.transpose:
            if n < 2:
                return None
            pair = _transposed(pair, n)
        return pair, n

    def unary(a: tuple[Pair, int]) -> Pair:
        return tuple("R" if p == "P" else p for p in a[0])

    for node in case.nodes:
        args = [use(u) for u in node.args]
        out: Pair | None = None
        if node.op == "transpose" and args[0] is not None and args[0][1] >= 2:
            out = _transposed(*args[0])
        elif node.op in _NONLINEAR_UNARY and args[0] is not None:
            out = unary(args[0])
        elif node.op == "matmul" and None not in args and args[0][1] == 2 and args[1][1] == 2:
            (a, _), (b, _) = args
            dims = [_mm(x, y) for x, y in zip(a, b)]
            out = None if None in dims else tuple(dims)  # type: ignore[arg-type]
        elif node.op == "add" and None not in args:
            out, dim = _add(args[0], args[1])  # type: ignore[arg-type]
            if dim is not None:
                return f"{node.name} (mesh dim {MESH_DIMS[dim]})"
        values[node.name] = out

    # The backward: each value's grad, the sum of its uses' contributions (None: not modelled).
    grads: dict[str, list[Pair | None]] = {}
    seed: Pair = ("P", "R") if partial_dp(case) else ("R", "R")
    for u in case.outputs:
        grads.setdefault(u.ref, []).append(_transposed(seed, 2) if u.transpose else seed)

    needs = {p.name for p in case.params if p.requires_grad} | {x.name for x in case.inputs if x.requires_grad}
    for node in case.nodes:
        if any(u.ref in needs for u in node.args):
            needs.add(node.name)

    def total(ref: str) -> tuple[Pair | None, str | None]:
        parts, n = grads.get(ref, []), ndim(ref)
        if ref not in needs or not parts or None in parts or n is None:
            return None, None
        acc: Pair = parts[0]  # type: ignore[assignment]
        for part in parts[1:]:
            summed, dim = _either_order((acc, n), (part, n))  # type: ignore[arg-type]
            if dim is not None:
                return None, f"the grad of {ref} (mesh dim {MESH_DIMS[dim]})"
            acc = summed  # type: ignore[assignment]
        return acc, None

    def give(u: Use, g: Pair | None) -> None:
        if g is not None and u.transpose:
            g = _transposed(g, 2) if ndim(u.ref) == 2 else None
        grads.setdefault(u.ref, []).append(g if u.index is None else None)

    for node in reversed(case.nodes):
        g, where = total(node.name)
        if where:
            return where
        args = [use(u) for u in node.args]
        if g is None or None in args:
            for u in node.args:
                give(u, None)
        elif node.op == "add" and all(a[1] == ndim(node.name) for a in args):  # type: ignore[index]
            for u in node.args:
                give(u, g)
        elif node.op == "transpose" and args[0][1] == 2:  # type: ignore[index]
            give(node.args[0], _transposed(g, 2))
        elif node.op in _NONLINEAR_UNARY:
            out, _ = _add((g, args[0][1]), args[0])  # type: ignore[arg-type,index]  # follows as a pointwise op does
            give(node.args[0], None if out is None else unary((out, 0)))
        elif node.op == "matmul" and args[0][1] == 2 and args[1][1] == 2:  # type: ignore[index]
            (a, _), (b, _) = args  # type: ignore[misc]
            da = [_mm(x, y) for x, y in zip(g, _transposed(b, 2))]  # dA = dC @ B^T
            db = [_mm(x, y) for x, y in zip(_transposed(a, 2), g)]  # dB = A^T @ dC
            give(node.args[0], None if None in da else tuple(da))  # type: ignore[arg-type]
            give(node.args[1], None if None in db else tuple(db))  # type: ignore[arg-type]
        else:
            for u in node.args:
                give(u, None)
    for ref in [*(p.name for p in case.params), *(x.name for x in case.inputs)]:
        where = total(ref)[1]
        if where:
            return where
    return None
