#!/usr/bin/env python
"""gradfuzz repro: SGD(momentum, nesterov=True, foreach=True).step() writes into param.grad.

The foreach implementation adds the momentum buffer into the grads in place
(torch._foreach_add_(grads, bufs, alpha=momentum)); the for-loop and fused
implementations leave .grad alone. Anything that reads .grad after the step
(logging, a second step on kept grads) sees grad + momentum * buf.
Run with plain python; exit status 1 when .grad changed.
"""
import sys

import torch


def grad_after_step(**impl):
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True, **impl).step()
    return p.grad.tolist()


if __name__ == "__main__":
    loop, foreach = grad_after_step(foreach=False), grad_after_step(foreach=True)
    print(f"torch {torch.__version__}: .grad after step: for-loop {loop}, foreach {foreach} (was [2.0, 2.0, 2.0])")
    print("DIVERGES" if loop != foreach else "agrees")
    sys.exit(1 if loop != foreach else 0)
