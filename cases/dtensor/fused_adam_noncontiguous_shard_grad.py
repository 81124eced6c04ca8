#!/usr/bin/env python
"""gradfuzz repro: CPU fused optimizers read a non-contiguous grad as if it were contiguous.

Adam/AdamW/SGD/Adagrad with fused=True on CPU update a parameter whose .grad
is non-contiguous (here: transposed strides, same values) with permuted grad
elements; the for-loop implementation is right. gradfuzz met it through
DTensor: a Shard(0) weight whose grad arrives Shard(1) is redistributed inside
_fused_adam_ into a non-contiguous local shard (see the .json beside this
file), and through split.stock, which sets .grad to a transposed dW.
Run with plain python; exit status 1 when the fused update differs.
"""
import sys

import torch

W = torch.tensor([[3.0, -3, -1], [1, 2, -2], [1, 2, -3]], dtype=torch.float64)
G = torch.tensor([[3.0, -9, 9], [1, -9, 15], [3, 27, 9]], dtype=torch.float64)


def step(cls, fused, **kw):
    p = torch.nn.Parameter(W.clone())
    p.grad = G.t().contiguous().t()  # G's values, column-major strides
    cls([p], lr=0.1, fused=fused, foreach=None if fused else False, **kw).step()
    return p.detach()


if __name__ == "__main__":
    bad = 0
    for cls, kw in ((torch.optim.Adam, {}), (torch.optim.AdamW, {}), (torch.optim.SGD, {"momentum": 0.9}),
                    (torch.optim.Adagrad, {})):
        loop, fused = step(cls, False, **kw), step(cls, True, **kw)
        same = torch.allclose(loop, fused, rtol=1e-12, atol=1e-12)
        bad += not same
        print(f"{cls.__name__:8} fused {'agrees' if same else 'DIVERGES'}: loop row 1 {loop[1].tolist()}, fused row 1 {fused[1].tolist()}")
    print(f"torch {torch.__version__}: {'DIVERGES' if bad else 'agrees'}")
    sys.exit(1 if bad else 0)
