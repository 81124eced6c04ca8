#!/usr/bin/env python
"""make_graphed_callables: an output that needs no grad comes back requiring grad.

Torch alone, one CUDA GPU. The module's output x @ w0 needs no grad (x and
w0 do not require it); its one trainable parameter u1 is unused. Eager: the
output has requires_grad False. The graphed callable returns its outputs
from an autograd.Function over every parameter and never marks the ones
that needed no grad at capture non-differentiable, so the output requires
grad. Since no output required grad at capture, no backward graph was
captured, and a backward through that output raises "Called
CUDAGraph::replay without a preceding successful capture" (where other
outputs do require grad, the extra output's grad is dropped silently).

Exit status 1 when graphed and eager differ.
"""
import sys

import torch


class Module(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w0 = torch.nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), requires_grad=False)
        self.u1 = torch.nn.Parameter(torch.ones(2, 2))  # trainable, unused

    def forward(self, x):
        return x @ self.w0


def main() -> int:
    m = Module().cuda()
    x = torch.tensor([[1.0, -1.0], [2.0, 0.5]], device="cuda")
    eager = m(x)
    g = torch.cuda.make_graphed_callables(m, (x.clone(),), allow_unused_input=True)
    out = g(x)
    print(f"torch {torch.__version__}")
    print(f"  eager output requires_grad={eager.requires_grad}; graphed output requires_grad={out.requires_grad}")
    raised = None
    if out.requires_grad:
        try:
            out.backward(torch.ones_like(out))
            torch.cuda.synchronize()
        except RuntimeError as e:
            raised = str(e).strip().splitlines()[0]
            print(f"  graphed backward raised RuntimeError: {raised}")
    bad = out.requires_grad != eager.requires_grad or raised is not None
    print("DIVERGES: the graphed output requires grad where eager's does not" if bad else "agrees")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
