#!/usr/bin/env python
"""make_graphed_callables runs the hooks of a parameter the callable never uses.

Torch alone, one CUDA GPU. The graphed callable passes every parameter of
the module into one autograd.Function; with allow_unused_input=True the
backward returns None for an unused one, and the autograd engine still runs
that parameter's AccumulateGrad: its tensor hook is called with None and its
post-accumulate-grad hook fires, where eager autograd never reaches the
parameter. A post-accumulate hook that steps an optimizer (the pattern the
docs give for optimizer-in-backward) then steps a parameter that got no
grad: with .grad zeroed, a stateful optimizer steps a zero grad (Adam still
moves it); with .grad prefilled, it steps the old grad again.

Exit status 1 when graphed and eager differ.
"""
import sys

import torch


class Module(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w0 = torch.nn.Parameter(torch.tensor([[3.0, -3.0, -1.0], [1.0, 2.0, -2.0], [1.0, 2.0, -3.0]]))
        self.u1 = torch.nn.Parameter(torch.tensor([[-1.0, 3.0, 3.0], [0.0, -3.0, 2.0], [2.0, 2.0, -2.0]]))  # unused

    def forward(self, x):
        return x @ self.w0


def run(graphed: bool) -> list:
    torch.manual_seed(0)
    m = Module().cuda()
    m.u1.grad = torch.zeros_like(m.u1)  # grads start zeroed (zero_grad(set_to_none=False))
    seen = []
    m.u1.register_hook(lambda g: seen.append(("u1 tensor hook", None if g is None else g.sum().item())))
    m.u1.register_post_accumulate_grad_hook(lambda p: seen.append(("u1 post-accumulate hook", p.grad.sum().item())))
    x = torch.tensor([[0.0, 3.0, 3.0], [0.0, -1.0, -3.0]], device="cuda", requires_grad=True)
    f = torch.cuda.make_graphed_callables(m, (x.detach().clone().requires_grad_(),), allow_unused_input=True) \
        if graphed else m
    f(x).backward(torch.ones(2, 3, device="cuda"))
    torch.cuda.synchronize()
    return seen


def main() -> int:
    eager, graphed = run(False), run(True)
    print(f"torch {torch.__version__}")
    print(f"  eager:   hooks of the unused u1 ran {eager}")
    print(f"  graphed: hooks of the unused u1 ran {graphed}")
    bad = eager != graphed
    print("DIVERGES: the graphed callable runs hooks of a parameter it never uses" if bad else "agrees")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
