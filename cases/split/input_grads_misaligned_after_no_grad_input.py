#!/usr/bin/env python
"""gradfuzz repro: inputs [x1 (no grad), x0]: 2.11's stage_backward_input
returns grads for the inputs that require grad only, so a caller pairing them
with its inputs gives x0's grad to x1 and none to x0; fine on 2.13.

Stage: out = (x0 * x1) @ w0, inputs passed as [x1, x0] (x1 needs no grad).
Expected: eager autograd (one grad per input, None for x1). Actual: the
tuple torch.distributed.pipelining._backward.stage_backward_input returns,
paired with the inputs by position, as the split paths and PipelineStage
(grads_input with grad_send_info) pair it. Written by hand: the generated
split script compares parameter grads only, and .grad on x0 is right on
2.11 too (the function sets it from the filtered list).
Run with plain python; exit status 1 when they differ.
"""
import sys

import torch
import torch.distributed.pipelining._backward as split_impl


def main() -> int:
    x0_data = torch.tensor([[1.0, -2.0, 3.0], [2.0, 0.0, -1.0]])
    x1_data = torch.tensor([[2.0, 1.0, -1.0], [-3.0, 2.0, 1.0]])
    w0_data = torch.tensor([[1.0, 2.0, 0.0], [-1.0, 1.0, 3.0], [2.0, -2.0, 1.0]])
    cot = torch.tensor([[1.0, -1.0, 2.0], [0.0, 3.0, -2.0]])

    # eager: the grads autograd gives each input
    x0 = x0_data.clone().requires_grad_(True)
    x1 = x1_data.clone()
    w0 = torch.nn.Parameter(w0_data.clone())
    (gx0,) = torch.autograd.grad((x0 * x1) @ w0, [x0], cot)
    expected = {"x1": None, "x0": gx0}

    # the split function
    x0 = x0_data.clone().requires_grad_(True)
    x1 = x1_data.clone()
    w0 = torch.nn.Parameter(w0_data.clone())
    out = (x0 * x1) @ w0
    inputs = {"x1": x1, "x0": x0}
    dinputs, groups = split_impl.stage_backward_input([out], [cot], list(inputs.values()), iter([w0]))
    split_impl.stage_backward_weight(iter([w0]), groups)
    got = dict(zip(inputs, list(dinputs) + [None] * (len(inputs) - len(dinputs))))
    print(f"stage_backward_input returned {len(dinputs)} input grad(s) for {len(inputs)} inputs")

    bad = 0
    for name, e in expected.items():
        a = got[name]
        same = (e is None and a is None) or (e is not None and a is not None and torch.allclose(a, e))
        if not same:
            bad += 1
            print(f"input grad {name}: expected {None if e is None else e.tolist()}, got {None if a is None else a.tolist()}")
    print(f"torch {torch.__version__}: {'DIVERGES' if bad else 'agrees'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
