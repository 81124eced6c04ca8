"""Compiled autograd (torch._dynamo.config.compiled_autograd = True, backward called in a
compiled function) with a compiled forward: a custom autograd.Function whose backward
uses Tensor.mT raises IndexError: list index out of range in the compiled backward.
With .t() instead of .mT, or with an eager forward, it runs."""
import sys

import torch


class MatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g @ b.mT, a.mT @ g


torch._dynamo.config.compiled_autograd = True
eager_forward = "--eager-forward" in sys.argv
w = torch.nn.Parameter(torch.randn(3, 3))
x = torch.randn(2, 3, requires_grad=True)
forward = (lambda x: MatMul.apply(x, w)) if eager_forward else torch.compile(lambda x: MatMul.apply(x, w), backend="aot_eager")
backward = torch.compile(lambda out: out.sum().backward(), backend="aot_eager")
try:
    backward(forward(x))
except IndexError as e:
    print(f"torch {torch.__version__}: BUG: the compiled backward raised IndexError: {e}")
    raise SystemExit(1)
ok = torch.allclose(w.grad, x.detach().mT @ torch.ones(2, 3)) and torch.allclose(x.grad, torch.ones(2, 3) @ w.detach().mT)
print(f"torch {torch.__version__}: ran; grads {'correct' if ok else 'WRONG'}")
raise SystemExit(0 if ok else 1)
