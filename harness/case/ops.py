"""The op vocabulary: shape rule, torch implementation and repro source.

One table, so that adding an op touches one place and the builder, the
validator and the repro writer cannot disagree about what an op means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from harness.case import opinfo
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
    # Builds a plain tensor of its own (an index, a target, a dropout mask)
    # and combines it with its operands: DTensor operands refuse that.
    plain_tensors: bool = False


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


# --- model parts ----------------------------------------------------------------
# Integer indices live in the case as attributes (``idx``, ``target``) or as a
# seed that draws them (``gather``, ``scatter_add``), so every case stays
# plain data and every path builds the same index tensors on its device.
# Bounds (the magnitude network, on absolute values): a bound op's value and
# its vector-Jacobian product dominate the real op's, term by term, so the
# tolerance scales with the terms summed (tests/cover/test_model_ops.py
# checks each against the op on random data).

NORM_EPS = 1e-2  # 1/sigma <= 10: norms keep their backward, the bound stays useful


def _need_2d(shapes: list[Shape], op: str) -> None:
    if any(len(s) != 2 for s in shapes):
        raise ShapeError(f"{op} needs 2-d operands, got {list(shapes)}")


def _norm_shape(shapes: list[Shape], attrs: dict) -> Shape:
    h, g = shapes
    if len(h) != 2 or g != (h[1],):
        raise ShapeError(f"a norm over the last dim of {h} needs a gain of shape ({h[-1] if h else '?'},), got {g}")
    return h


def _index_ok(idx: tuple, n: int, what: str) -> None:
    if any(i >= n for i in idx):
        raise ShapeError(f"{what} {tuple(idx)} out of range for a dim of size {n}")


def _embedding_shape(shapes: list[Shape], attrs: dict) -> Shape:
    (e,) = shapes
    _need_2d(shapes, "embedding")
    idx = tuple(attrs.get("idx", ()))
    _index_ok(idx, e[0], "embedding indices")
    pad = attrs.get("padding_idx")
    if pad is not None and not 0 <= pad < e[0]:
        raise ShapeError(f"padding_idx {pad} out of range for {e[0]} rows")
    return (len(idx), e[1])


def _ce_shape(shapes: list[Shape], attrs: dict) -> Shape:
    (h,) = shapes
    _need_2d(shapes, "cross_entropy")
    target = tuple(attrs.get("target", ()))
    if len(target) != h[0]:
        raise ShapeError(f"cross_entropy needs one target per row of {h}, got {len(target)}")
    _index_ok(target, h[1], "targets")
    return ()


def _sdpa_shape(shapes: list[Shape], attrs: dict) -> Shape:
    q, k, v = shapes
    _need_2d(shapes, "sdpa")
    if q[1] != k[1] or k[0] != v[0]:
        raise ShapeError(f"attention needs q (L, E), k (S, E), v (S, Ev); got {q}, {k}, {v}")
    if attrs.get("causal", 0) and q[0] != k[0]:
        raise ShapeError(f"causal attention needs L == S, got {q[0]} and {k[0]}")
    return (q[0], v[1])


def _expand_shape(shapes: list[Shape], attrs: dict) -> Shape:
    (a,) = shapes
    new = tuple(attrs.get("shape", ()))
    if len(new) != len(a) or any(x != y and x != 1 for x, y in zip(a, new)):
        raise ShapeError(f"cannot expand {a} to {new}")
    return new


def _index_select_shape(shapes: list[Shape], attrs: dict) -> Shape:
    (a,) = shapes
    d = _dim_of(a, attrs)
    idx = tuple(attrs.get("idx", ()))
    _index_ok(idx, a[d], "indices")
    return a[:d] + (len(idx),) + a[d + 1:]


def _scatter_shape(shapes: list[Shape], attrs: dict) -> Shape:
    if any(s != shapes[0] for s in shapes) or len(shapes[0]) != 2:
        raise ShapeError(f"gather/scatter_add here take 2-d operands of one shape, got {list(shapes)}")
    _dim_of(shapes[0], attrs)
    return shapes[0]


def _index_add_shape(shapes: list[Shape], attrs: dict) -> Shape:
    a, src = shapes
    idx = tuple(attrs.get("idx", ()))
    if len(a) != 2 or src[1:] != a[1:] or len(idx) != src[0]:
        raise ShapeError(f"index_add into {a} needs a source (len(idx), {a[1:]}), got {src} with {len(idx)} indices")
    _index_ok(idx, a[0], "indices")
    return a


_IX: dict[tuple, torch.Tensor] = {}  # index tensors by device, built once (_ix, seeded_index)


def seeded_index(seed: int, shape: Shape, high: int, device: Any = "cpu") -> torch.Tensor:
    """The index tensor a ``seed`` attribute stands for (gather, scatter_add).
    Built once per device (as ``_ix``): a CUDA graph capture refuses the copy
    from host memory, and the graphed paths' warm-ups build it first."""
    key = ("seeded", seed, tuple(shape), high, str(device))
    return _cached(key, lambda: torch.randint(0, high, tuple(shape), generator=torch.Generator().manual_seed(seed)).to(device))


def _cached(key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    # Not kept when torch.compile traces the call: a tensor made in the traced
    # region is a graph output, which under mode="reduce-overhead" lives in
    # the CUDA-graph pool, and the next run overwrites it ("accessing tensor
    # output of CUDAGraphs that has been overwritten", raised in the next
    # case's trace: graphed.compile-error-f1a75e4745 on torch 2.11).
    # Nor inside a torch.func transform, read or written: a tensor made there is
    # the transform's wrapper (kept, it leaks a dead level), and one made outside
    # would hide what the transform does to a tensor the forward builds, so a
    # verdict would depend on what ran before in the process.
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return make()
    ix = _IX.get(key)
    if ix is None:
        ix = make()
        if not torch.compiler.is_compiling():
            _IX[key] = ix
    return ix


def _seeded_src(s: list[str], a: dict) -> str:
    d = a.get("dim", 0)
    return (f"torch.randint(0, {s[0]}.shape[{d}], {s[0]}.shape, generator=torch.Generator().manual_seed({a['seed']}))"
            f".to({s[0]}.device)")


def _ix(t: torch.Tensor, idx: Any) -> torch.Tensor:
    # Built once per device and index, then reused: building it from host data
    # copies from pageable memory, which a CUDA graph capture refuses (the
    # graphed paths' warm-ups run the forward first, so the capture finds it
    # here). Read-only, never written by the ops that take it.
    key = (str(t.device), tuple(idx))
    return _cached(key, lambda: torch.tensor(key[1], dtype=torch.long, device=t.device))


def _softmax_bound(x: torch.Tensor) -> torch.Tensor:
    # |softmax| <= 1; |J^T dy|_j = |y_j (dy_j - sum_i y_i dy_i)| <= 2 sum_i |dy_i|
    return 1 + 2 * x.sum(-1, keepdim=True).expand_as(x)


def _norm_bound(t: list[torch.Tensor], a: dict) -> torch.Tensor:
    # |y| <= sqrt(D) |g|; |dh_j| <= (D + 2) / sigma * sum_i |g_i dy_i|, sigma >= sqrt(eps); |dg| <= sqrt(D) sum |dy|
    h, g = t
    c = (h.shape[-1] + 2) / math.sqrt(NORM_EPS)
    return c * (1 + h.sum(-1, keepdim=True)) * g


def _sdpa(t: list[torch.Tensor], a: dict) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(t[0], t[1], t[2], is_causal=bool(a.get("causal", 0)))


def _sdpa_bound(t: list[torch.Tensor], a: dict) -> torch.Tensor:
    q, k, v = t
    return _softmax_bound(q @ k.mT / math.sqrt(q.shape[-1])) @ v


def _opinfo_shape(shapes: list[Shape], attrs: dict) -> Shape:
    if "fn" not in attrs or "call" not in attrs:
        raise ShapeError("an opinfo node needs both attributes fn and call")
    if attrs["fn"] not in opinfo.table():
        if opinfo.elsewhere(attrs["fn"]):
            return shapes[0]  # another torch's op: valid data, refused before it runs (opinfo.unavailable)
        raise ShapeError(opinfo.missing(attrs["fn"]))
    opinfo.callable_of(attrs["fn"])  # resolved here, outside any traced forward
    return shapes[0]


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
           bound=lambda t, a: t[0] * 2, random=True, plain_tensors=True),
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
        # Model parts (drawn only for paths whose contract asks: ``model_parts``).
        Op("gelu", 1, 1, False, _same, lambda t, a: torch.nn.functional.gelu(t[0]),
           lambda s, a: f"torch.nn.functional.gelu({s[0]})", bound=lambda t, a: 1.2 * t[0]),
        Op("silu", 1, 1, False, _same, lambda t, a: torch.nn.functional.silu(t[0]),
           lambda s, a: f"torch.nn.functional.silu({s[0]})", bound=lambda t, a: 1.2 * t[0]),
        Op("softmax", 1, 1, False, _same, lambda t, a: torch.softmax(t[0], dim=-1),
           lambda s, a: f"torch.softmax({s[0]}, dim=-1)", bound=lambda t, a: _softmax_bound(t[0])),
        Op("log_softmax", 1, 1, False, _same, lambda t, a: torch.log_softmax(t[0], dim=-1),
           lambda s, a: f"torch.log_softmax({s[0]}, dim=-1)",
           bound=lambda t, a: math.log(t[0].shape[-1]) + _softmax_bound(t[0])),
        Op("layer_norm", 2, 2, False, _norm_shape,
           lambda t, a: torch.nn.functional.layer_norm(t[0], (t[0].shape[-1],), t[1], None, eps=NORM_EPS),
           lambda s, a: f"torch.nn.functional.layer_norm({s[0]}, ({s[0]}.shape[-1],), {s[1]}, None, eps={NORM_EPS})",
           bound=_norm_bound),
        Op("rms_norm", 2, 2, False, _norm_shape,
           lambda t, a: torch.nn.functional.rms_norm(t[0], (t[0].shape[-1],), t[1], eps=NORM_EPS),
           lambda s, a: f"torch.nn.functional.rms_norm({s[0]}, ({s[0]}.shape[-1],), {s[1]}, eps={NORM_EPS})",
           bound=_norm_bound),
        Op("embedding", 1, 1, True, _embedding_shape,
           lambda t, a: torch.nn.functional.embedding(_ix(t[0], a["idx"]), t[0], padding_idx=a.get("padding_idx")),
           lambda s, a: f"torch.nn.functional.embedding(torch.tensor({tuple(a['idx'])}, device={s[0]}.device), {s[0]}, "
                        f"padding_idx={a.get('padding_idx')!r})", plain_tensors=True),
        Op("cross_entropy", 1, 1, False, _ce_shape,
           lambda t, a: torch.nn.functional.cross_entropy(t[0], _ix(t[0], a["target"])),
           lambda s, a: f"torch.nn.functional.cross_entropy({s[0]}, torch.tensor({tuple(a['target'])}, device={s[0]}.device))",
           bound=lambda t, a: (math.log(t[0].shape[-1]) + 2 * t[0].sum(-1)).mean(), plain_tensors=True),
        Op("sdpa", 3, 3, False, _sdpa_shape, _sdpa,
           lambda s, a: f"torch.nn.functional.scaled_dot_product_attention({s[0]}, {s[1]}, {s[2]}, "
                        f"is_causal={bool(a.get('causal', 0))})",
           bound=_sdpa_bound),
        Op("add_", 2, 2, True, _broadcast_first, lambda t, a: t[0].clone().add_(t[1]),
           lambda s, a: f"{s[0]}.clone().add_({s[1]})"),
        Op("expand", 1, 1, True, _expand_shape, lambda t, a: t[0].expand(tuple(a["shape"])),
           lambda s, a: f"{s[0]}.expand({tuple(a['shape'])})"),
        Op("index_select", 1, 1, True, _index_select_shape,
           lambda t, a: t[0].index_select(a.get("dim", 0), _ix(t[0], a["idx"])),
           lambda s, a: f"{s[0]}.index_select({a.get('dim', 0)}, torch.tensor({tuple(a['idx'])}, device={s[0]}.device))", plain_tensors=True),
        Op("gather", 1, 1, True, _scatter_shape,
           lambda t, a: t[0].gather(a.get("dim", 0), seeded_index(a["seed"], t[0].shape, t[0].shape[a.get("dim", 0)],
                                                                 t[0].device)),
           lambda s, a: f"{s[0]}.gather({a.get('dim', 0)}, {_seeded_src(s, a)})", plain_tensors=True),
        Op("scatter_add", 2, 2, True, _scatter_shape,
           lambda t, a: t[0].scatter_add(a.get("dim", 0), seeded_index(a["seed"], t[0].shape, t[0].shape[a.get("dim", 0)],
                                                                       t[0].device), t[1]),
           lambda s, a: f"{s[0]}.scatter_add({a.get('dim', 0)}, {_seeded_src(s, a)}, {s[1]})", plain_tensors=True),
        Op("index_add", 2, 2, True, _index_add_shape,
           lambda t, a: t[0].index_add(0, _ix(t[0], a["idx"]), t[1]),
           lambda s, a: f"{s[0]}.index_add(0, torch.tensor({tuple(a['idx'])}, device={s[0]}.device), {s[1]})", plain_tensors=True),
        # An op of torch's OpInfo database on h (harness.case.opinfo): tolerance mode only;
        # on a DTensor h its operands are DTensors too (opinfo.mesh_refusal says which run).
        # Its constants are made on every call, never cached: a recomputation (selective checkpoint
        # replays its saved ops in order) must run the ops the first forward ran, whatever ran before.
        Op("opinfo", 1, 1, False, _opinfo_shape, lambda t, a: opinfo.run(t, a), opinfo.source,
           bound=opinfo.bound),
    ]
}


def draws_random(case: Any) -> bool:
    """Whether the case's forward draws random numbers (dropout): paths that
    replay a graph or compile per structure must then keep the seed in view."""
    return any(node_random(n) for n in case.nodes)


def node_inplace(node: Any) -> bool:
    """Whether this node writes into its first operand (mul_, an OpInfo op's in-place variant)."""
    return node.op.endswith("_") or (node.op == "opinfo" and str(node.attr("fn", "")).endswith(opinfo.INPLACE))


def node_random(node: Any) -> bool:
    """Whether this node draws from the global RNG (dropout, a random OpInfo op)."""
    return OPS[node.op].random or (node.op == "opinfo" and opinfo.is_random(node.attr("fn")))
