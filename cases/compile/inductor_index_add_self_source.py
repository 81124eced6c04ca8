#!/usr/bin/env python
"""gradfuzz repro (torch only): Inductor's index_add with its own input as the
source, on an intermediate. Exit status 1 when the compiled forward differs."""
import sys

import torch

IDX = torch.tensor([1, 2, 0])


def f(x0, b0):
    n = x0 + b0
    return n.index_add(0, IDX, n)


def main():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 2, dtype=torch.float64, generator=g)
    b0 = torch.randn(2, dtype=torch.float64, generator=g)
    want = f(x0, b0)
    bad = 0
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        got = torch.compile(f, backend=backend)(x0, b0)
        same = torch.allclose(got, want)
        bad += not same
        print(f"{backend}: {'agrees' if same else 'DIFFERS'}" + ("" if same else f"\n  expected {want.tolist()}\n  got      {got.tolist()}"))
    print(f"torch {torch.__version__}: {'DIVERGES' if bad else 'agrees'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
