"""The op vocabulary: shape rule, torch implementation and repro source.

One table, so that adding an op touches one place and the builder, the
validator and the repro writer cannot disagree about what an op means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from harness.case.functions import LayoutMatmul, Pair, PassThrough

Shape = tuple[int, ...]
Result = Shape | tuple[Shape, ...]


class ShapeError(ValueError):
    pass


@dataclass(frozen=True)
class Op:
    name: str
    min_args: int
    max_args: int
    exact: bool  # small integers in, small integers out: usable in exact mode
    shape: Callable[[list[Shape], dict[str, Any]], Result]
    run: Callable[[list[torch.Tensor], dict[str, Any]], Any]
    source: Callable[[list[str], dict[str, Any]], str]
    outputs: int = 1
    # In the magnitude-bound network (|inputs|, nonlinearities as identity)
    # this op is replaced by ``bound``; None means ``run`` already bounds.
    bound: Callable[[list[torch.Tensor], dict[str, Any]], Any] | None = None
    # Draws from the global RNG (dropout): a recomputation must restore it.
    random: bool = False


def _same(shapes: list[Shape], attrs: dict) -> Shape:
    return shapes[0]


def _broadcast(shapes: list[Shape], attrs: dict) -> Shape:
    try:
        out = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        raise ShapeError(f"shapes {list(shapes)} do not broadcast") from None
    if out not in shapes:
        raise ShapeError(f"shapes {list(shapes)} broadcast to {out}, larger than either operand")
    return out


def _broadcast_first(shapes: list[Shape], attrs: dict) -> Shape:
    out = _broadcast(shapes, attrs)
    if out != shapes[0]:
        raise ShapeError(f"in-place op on {shapes[0]} cannot take the broadcast shape {out}")
    return out


def _matmul(shapes: list[Shape], attrs: dict) -> Shape:
    a, b = shapes
    if len(a) != 2 or len(b) != 2:
        raise ShapeError(f"matmul needs 2-d operands, got {a} and {b}")
    if a[1] != b[0]:
        raise ShapeError(f"matmul inner dims differ: {a} @ {b}")
    return (a[0], b[1])


def _transpose(shapes: list[Shape], attrs: dict) -> Shape:
    (a,) = shapes
    if len(a) < 2:
        raise ShapeError(f"transpose needs at least 2 dims, got {a}")
    return a[:-2] + (a[-1], a[-2])


def _reshape(shapes: list[Shape], attrs: dict) -> Shape:
    (a,) = shapes
    new = tuple(attrs.get("shape", ()))
    if not new or math.prod(new) != math.prod(a):
        raise ShapeError(f"cannot reshape {a} to {new}")
    return new


def _reduce(shapes: list[Shape], attrs: dict) -> Shape:
    (a,) = shapes
    dim = attrs.get("dim")
    if dim is None:
        return ()
    if not -len(a) <= dim < len(a):
        raise ShapeError(f"dim {dim} out of range for {a}")
    return tuple(d for i, d in enumerate(a) if i != dim % len(a))


def _dim_of(a: Shape, attrs: dict) -> int:
    dim = attrs.get("dim", 0)
    if not -len(a) <= dim < len(a):
        raise ShapeError(f"dim {dim} out of range for {a}")
    return dim % len(a)


def _chunk(shapes: list[Shape], attrs: dict) -> tuple[Shape, ...]:
    (a,) = shapes
    n = attrs.get("chunks", 2)
    d = _dim_of(a, attrs)
    if n < 2 or a[d] % n:
        raise ShapeError(f"dim {d} of {a} does not split into {n} equal chunks")
    part = a[:d] + (a[d] // n,) + a[d + 1 :]
    return tuple(part for _ in range(n))


def _cat(shapes: list[Shape], attrs: dict) -> Shape:
    a = shapes[0]
    d = _dim_of(a, attrs)
    for s in shapes[1:]:
        if len(s) != len(a) or s[:d] + s[d + 1 :] != a[:d] + a[d + 1 :]:
            raise ShapeError(f"cannot cat {list(shapes)} on dim {d}")
    return a[:d] + (sum(s[d] for s in shapes),) + a[d + 1 :]


def _stack(shapes: list[Shape], attrs: dict) -> Shape:
    a = shapes[0]
    if any(s != a for s in shapes):
        raise ShapeError(f"cannot stack different shapes {list(shapes)}")
    d = attrs.get("dim", 0)
    if not 0 <= d <= len(a):
        raise ShapeError(f"stack dim {d} out of range for {a}")
    return a[:d] + (len(shapes),) + a[d:]


def _pair(shapes: list[Shape], attrs: dict) -> tuple[Shape, Shape]:
    a, b = shapes
    if a != b:
        raise ShapeError(f"pair needs equal shapes, got {a} and {b}")
    return (a, a)


def _layout_matmul_shape(shapes: list[Shape], attrs: dict) -> Shape:
    if attrs.get("layout", "contiguous") not in LAYOUTS:
        raise ShapeError(f"unknown grad layout {attrs.get('layout')!r}; one of {LAYOUTS}")
    return _matmul(shapes, attrs)


LAYOUTS = ("contiguous", "transposed", "buffer_view")


def _dropout(t: list[torch.Tensor], a: dict) -> torch.Tensor:
    """Dropout with p=1/2 and scale 2 (integers stay integers in exact mode).
    The mask comes from the global RNG in float64 whatever the case dtype, so
    the oracle and a float32 path draw the same mask from the same state."""
    keep = torch.rand(t[0].shape, dtype=torch.float64) >= 0.5
    return t[0] * keep.to(t[0].device, t[0].dtype) * 2


def _dim_src(attrs: dict) -> str:
    return f"dim={attrs.get('dim', 0)}"


OPS: dict[str, Op] = {
    op.name: op
    for op in [
        Op("matmul", 2, 2, True, _matmul, lambda t, a: t[0] @ t[1], lambda s, a: f"{s[0]} @ {s[1]}"),
        Op("mul", 2, 2, True, _broadcast, lambda t, a: t[0] * t[1], lambda s, a: f"{s[0]} * {s[1]}"),
        Op("add", 2, 2, True, _broadcast, lambda t, a: t[0] + t[1], lambda s, a: f"{s[0]} + {s[1]}"),
        Op("transpose", 1, 1, True, _transpose, lambda t, a: t[0].mT, lambda s, a: f"{s[0]}.mT"),
        Op(
            "reshape", 1, 1, True, _reshape,
            lambda t, a: t[0].reshape(a["shape"]),
            lambda s, a: f"{s[0]}.reshape({tuple(a['shape'])})",
        ),
        Op(
            "sum", 1, 1, True, _reduce,
            lambda t, a: t[0].sum() if a.get("dim") is None else t[0].sum(dim=a["dim"]),
            lambda s, a: f"{s[0]}.sum()" if a.get("dim") is None else f"{s[0]}.sum(dim={a['dim']})",
        ),
        Op(
            "mean", 1, 1, False, _reduce,
            lambda t, a: t[0].mean() if a.get("dim") is None else t[0].mean(dim=a["dim"]),
            lambda s, a: f"{s[0]}.mean()" if a.get("dim") is None else f"{s[0]}.mean(dim={a['dim']})",
        ),
        Op("tanh", 1, 1, False, _same, lambda t, a: torch.tanh(t[0]), lambda s, a: f"torch.tanh({s[0]})",
           bound=lambda t, a: t[0]),
        Op("relu", 1, 1, True, _same, lambda t, a: torch.relu(t[0]), lambda s, a: f"torch.relu({s[0]})",
           bound=lambda t, a: t[0]),
        Op(
            "layout_matmul", 2, 2, True, _layout_matmul_shape,
            lambda t, a: LayoutMatmul.apply(t[0], t[1], a.get("layout", "contiguous")),
            lambda s, a: f"LayoutMatmul.apply({s[0]}, {s[1]}, {a.get('layout', 'contiguous')!r})",
        ),
        Op("passthrough", 1, 1, True, _same, lambda t, a: PassThrough.apply(t[0]),
           lambda s, a: f"PassThrough.apply({s[0]})"),
        Op("pair", 2, 2, True, _pair, lambda t, a: Pair.apply(t[0], t[1]),
           lambda s, a: f"Pair.apply({s[0]}, {s[1]})", outputs=2),
        Op(
            "chunk", 1, 1, True, _chunk,
            lambda t, a: t[0].chunk(a.get("chunks", 2), dim=a.get("dim", 0)),
            lambda s, a: f"{s[0]}.chunk({a.get('chunks', 2)}, {_dim_src(a)})",
            outputs=-1,
        ),
        Op("dropout", 1, 1, True, _same, _dropout,
           lambda s, a: f"{s[0]} * (torch.rand({s[0]}.shape, dtype=torch.float64) >= 0.5).to({s[0]}.dtype) * 2",
           bound=lambda t, a: t[0] * 2, random=True),
        # In-place ops on a fresh copy, so SSA names keep their values: the
        # in-place kernel, its version bump and what it saves are what a
        # recomputation has to reproduce.
        Op("relu_", 1, 1, True, _same, lambda t, a: t[0].clone().relu_(),
           lambda s, a: f"{s[0]}.clone().relu_()", bound=lambda t, a: t[0].clone()),
        Op("mul_", 2, 2, True, _broadcast_first, lambda t, a: t[0].clone().mul_(t[1]),
           lambda s, a: f"{s[0]}.clone().mul_({s[1]})"),
        Op("cat", 2, 4, True, _cat, lambda t, a: torch.cat(t, dim=a.get("dim", 0)),
           lambda s, a: f"torch.cat([{', '.join(s)}], {_dim_src(a)})"),
        Op("stack", 2, 4, True, _stack, lambda t, a: torch.stack(t, dim=a.get("dim", 0)),
           lambda s, a: f"torch.stack([{', '.join(s)}], {_dim_src(a)})"),
    ]
}
