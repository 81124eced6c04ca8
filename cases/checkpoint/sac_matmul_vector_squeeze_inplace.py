#!/usr/bin/env python
"""gradfuzz repro: selective activation checkpointing raises on a vector-matrix product.

torch.matmul(x, w) with x 1-D and w 2-D (and F.linear of a 1-D input,
which F.linear_cross_entropy calls) is ATen's composite
x.unsqueeze(0).mm(w).squeeze_(0): it squeezes mm's output in place. A
selective-checkpoint policy that saves aten.mm (the usual "save the
matmuls" policy) caches that output; the squeeze_ bumps its version, and
when backward recomputes the region (log_softmax needs it here) the cache
check raises "Tensor cached during selective activation checkpoint has been
mutated". Eager autograd and full recomputation run it. Seen on torch
2.11.0, 2.13.0 and 2.14.1 (CPU).
Run:  python THIS_FILE      Exit status 1 when the checkpointed run raises or differs.
"""
import functools
import sys

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def f(x, w):
    return torch.log_softmax(torch.matmul(x, w), 0)[1]


def main() -> int:
    torch.manual_seed(0)
    x, w = torch.randn(3, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    f(x, w).backward()
    want = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    try:
        y = checkpoint(f, x, w, use_reentrant=False,
                       context_fn=functools.partial(create_selective_checkpoint_contexts, save_matmuls))
        y.backward()
        bad = not (torch.allclose(x.grad, want[0]) and torch.allclose(w.grad, want[1]))
        what = "grads differ from eager" if bad else "grads agree with eager"
    except RuntimeError as e:
        bad, what = True, f"backward raised RuntimeError: {e}"
    print(f"torch {torch.__version__}: {'DIVERGES' if bad else 'agrees'}: {what}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
