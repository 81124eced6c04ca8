"""Model parts (``cases(model=True)``): the pieces transformers are made of,
each a block that keeps h's shape, so they mix with every founding block and
shrink the same way."""

from __future__ import annotations

from harness.case.spec import Use
from harness.generate.builder import _Builder


def _vocab(b: _Builder) -> int:
    return b.dim + 1  # unlike any (D, D) weight, so an embedding ties only with embeddings


def _embed(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if not b.grows(1.0):
        return h
    V = _vocab(b)
    e = b.param((V, b.dim), slot, prefix="e")
    idx = tuple((variant + 2 * i + slot) % V for i in range(b.batch))
    pad = {"padding_idx": idx[0]} if variant == 3 else {}
    b.bound += 3.0
    return b.node("add", Use(h), Use(b.node("embedding", Use(e), idx=idx, **pad)))


def _head(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    D, V = b.dim, _vocab(b)
    if not b.grows(9.0 * D * V):
        return h
    e = b.param((V, D), slot, prefix="e")
    logits = b.node("matmul", Use(h), Use(e, transpose=True))
    if not b.exact and variant >= 2:
        b.losses.append(b.node("cross_entropy", Use(logits), target=tuple((slot + 3 * i) % V for i in range(b.batch))))
    if not b.exact:
        logits = b.node("softmax" if variant % 2 else "log_softmax", Use(logits))
    return b.node("matmul", Use(logits), Use(e))


def _norm_node(b: _Builder, h: str, slot: int, variant: int) -> str:
    g = b.param((b.dim,), slot, prefix="g")
    return b.node("rms_norm" if variant % 2 else "layer_norm", Use(h), Use(g))


def _norm(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    return h if b.exact else _norm_node(b, h, slot, variant)


def _attention(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if b.exact:
        return h
    D = b.dim
    a = _norm_node(b, h, slot, variant)
    wq, wk, wv = (b.param((D, D), slot + i) for i in range(3))
    q, k, v = (b.node("matmul", Use(a), Use(w)) for w in (wq, wk, wv))
    o = b.node("sdpa", Use(q), Use(k), Use(v), causal=int(variant >= 2))
    return b.node("add", Use(h), Use(b.node("matmul", Use(o), Use(b.param((D, D), slot)))))


def _mlp(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if b.exact:
        return h
    D = b.dim
    w1, w2 = b.param((D, D), slot), b.param((D, D), slot + 1)
    up = b.node("matmul", Use(h), Use(w1))
    gate = b.node("silu" if variant % 2 else "gelu", Use(b.node("matmul", Use(h), Use(w2))))
    down = Use(w1, transpose=True) if variant < 2 else Use(b.param((D, D), slot + 2))
    return b.node("add", Use(h), Use(b.node("matmul", Use(b.node("mul", Use(up), Use(gate))), down)))


def _index(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    B, D = b.batch, b.dim
    if variant == 0:
        return b.node("index_select", Use(h), dim=1, idx=tuple((slot + 3 * i) % D for i in range(D)))
    if variant == 1:
        return b.node("gather", Use(h), dim=1, seed=slot * 7 + 1)
    if not b.grows(float(B + 1)):
        return h
    if variant == 2:
        return b.node("scatter_add", Use(h), Use(h), dim=0, seed=slot * 7 + 2)
    return b.node("index_add", Use(h), Use(h), idx=tuple((slot + i) % B for i in range(B)))


def _expand(b: _Builder, h: str, block: str, slot: int, variant: int) -> str:
    if not b.grows(3.0):
        return h
    g = b.param((1, b.dim), slot, prefix="g")
    return b.node("mul", Use(h), Use(b.node("expand", Use(g), shape=(b.batch, b.dim))))


MODEL_BUILDERS = {
    "embed": _embed, "head": _head, "norm": _norm, "attention": _attention, "mlp": _mlp, "index": _index,
    "expand": _expand,
}
