"""Custom autograd Functions used by generated modules.

They exist because custom backward code is where grad layouts go wrong: a
backward that returns a transposed (non-contiguous) grad or a view into a
larger buffer is legal, and machinery downstream (AccumulateGrad's layout
fix-up, DTensor placements, static graph buffers) must cope with it. This
module imports only torch: ``harness.artifacts.repro`` pastes its source into
standalone scripts.

They are written with ``setup_context`` (forward without ``ctx``) and
``generate_vmap_rule``, the form torch.func's transforms (grad, vjp, vmap)
accept; for plain autograd it means exactly what ``forward(ctx, ...)`` did.
"""

import torch


class LayoutMatmul(torch.autograd.Function):
    """``a @ b`` whose backward returns grads in a chosen memory layout."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b, layout):
        return a @ b

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, layout = inputs
        ctx.save_for_backward(a, b)
        ctx.layout = layout

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        if ctx.layout == "transposed":
            # Same values as the contiguous form, strides swapped.
            ga, gb = (b @ g.mT).mT, (g.mT @ a).mT
        elif ctx.layout == "buffer_view":
            # Each grad is a slice of a larger buffer, at a storage offset:
            # the second of a plain zero buffer stacked with it (out of
            # place, so vmap can batch it; a copy_ into the buffer it cannot).
            ga = torch.stack([torch.zeros(a.shape, dtype=g.dtype, device=g.device), g @ b.mT])[1]
            gb = torch.stack([torch.zeros(b.shape, dtype=g.dtype, device=g.device), a.mT @ g])[1]
        else:
            ga, gb = g @ b.mT, a.mT @ g
        return ga, gb, None


class Pair(torch.autograd.Function):
    """Two outputs from two inputs: ``(a * b, a + b)``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b):
        return a * b, a + b

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g_mul, g_add):
        a, b = ctx.saved_tensors
        ga = torch.zeros_like(a)
        gb = torch.zeros_like(b)
        if g_mul is not None:
            ga = ga + g_mul * b
            gb = gb + g_mul * a
        if g_add is not None:
            ga = ga + g_add
            gb = gb + g_add
        return ga, gb


class PassThrough(torch.autograd.Function):
    """The identity, whose backward hands autograd's incoming grad on as the
    very same tensor: downstream, a grad that arrives untouched from the
    caller's grad output is what an implementation adopting autograd's
    tensor as ``.grad`` aliases (the founding graphed bug's class)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a):
        return a.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g
