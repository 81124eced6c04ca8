#!/usr/bin/env python
"""Inductor on CPU: frexp on float64 builds a vectorized C++ kernel that g++ refuses.

The kernel holds frexp's int32 exponent in as many vectors as the float64
input takes (two), and converts it back as if it took int32's own count (one):
"no matching function for call to convert<double, 2, int32_t, 1>". Eager runs
the same function; float32 compiles. Exit status 1 while the bug is there.
"""
import sys

import torch


def f(x):
    mantissa, exponent = torch.frexp(x)
    return mantissa * exponent


def main() -> int:
    x = torch.linspace(-8.25, 7.3, 20, dtype=torch.float64)
    wrong = 0
    for dtype in (torch.float32, torch.float64):
        for dynamic in (False, True):
            torch._dynamo.reset()
            try:
                same = torch.equal(torch.compile(f, dynamic=dynamic)(x.to(dtype)), f(x.to(dtype)))
                what = "agrees" if same else "DIFFERS"
            except Exception as e:  # the compile's own error, shown in one line
                same, what = False, f"RAISES {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            wrong += not same
            print(f"torch {torch.__version__} {dtype} dynamic={dynamic}: {what}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
